"""Host time of ``PagedKVCache.load_static`` (a suite slot refilled from a batch's shared prefill, evaluation/slots.py) on
the CPU: 28 paged layers at a tiny width (Qwen2.5-1.5B's depth), 8 sequences of 8K, blocks of 16; five timed refills,
then a profile of three by own time. ``python benchmarks/probe_load_static.py``"""

import copy
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model


def main() -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=20000,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    patch_model(model, block_size=16)
    ids = torch.randint(1, 64, (8, 8192))
    prefix = PagedKVCache(model.config, block_size=16)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): prefix}, logits_to_keep=1)
    slot = copy.deepcopy(prefix)
    slot.reserve_static(8192 + 64, any_padding=True)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        slot.load_static(prefix)
        times.append(time.perf_counter() - t)
    print("load_static ms:", [round(1000 * x, 1) for x in times])
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        slot.load_static(prefix)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    print(s.getvalue()[:3000])


if __name__ == "__main__":
    main()
