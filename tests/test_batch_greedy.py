"""Needle/QA answers for several prompts in one left-padded batch equal the answers one prompt at a time."""

import pytest
import torch
from tiny_models import tiny_model

from evaluation.needle import greedy_batch, greedy_under_policies
from hf_sparse_kv import is_patched
from hf_sparse_kv.policies import Dense, OracleBlockTopK, Quest, SnapKV, TokenTopK


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_greedy_equals_one_at_a_time(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (150, 131, 144)]
    policies = {
        "dense": Dense(),
        "quest": Quest(budget=0.25, sink=4, window=16),
        "oracle": OracleBlockTopK(budget=0.25, sink=4, window=16),
        "token": TokenTopK(budget=0.25, sink=4, window=16),
        "snapkv": SnapKV(budget=0.5, sink=4, window=16, observe=8),
    }
    if arch == "gemma3":  # sliding + global layers: the padding must reach both kinds of mask
        policies = {k: policies[k] for k in ("dense", "quest", "snapkv")}
    mode = "block" if arch == "llama" else "mask"
    batched = greedy_batch(model, prompts, policies, 6, dense_layers=(0,), block_size=8, mode=mode)
    for prompt, got in zip(prompts, batched):
        one = greedy_under_policies(model, torch.tensor([prompt]), policies, 6, (0,), 8, mode)
        assert got == one
    assert not is_patched(model)
