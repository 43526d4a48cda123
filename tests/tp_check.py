"""Tensor parallelism (transformers' ``tp_plan="auto"``) under a patched model; ``tests/test_tensor_parallel.py`` runs::

    torchrun --nproc-per-node 2 tests/tp_check.py --out result.json

Rank 0 saves a tiny random Llama (4 layers, 8 query / 4 KV heads, head dim 64) with ``save_pretrained``; every rank
loads it with ``from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto"))`` (each rank holds half of
the heads, and half of every layer's pages) and also whole, on its own device, as the one-device reference.
Checked, on one prompt and on a left-padded batch of two:

- Dense patched under TP gives the greedy tokens of the unpatched TP model, logits within ``ATOL``;
- Quest under TP gives the greedy tokens of Quest on one device (the logits' largest difference is reported, not
  checked: a near-tie in the block ranking may fall the other way when a rank computes its heads' projections in a
  slice; ~1e-6 on the CPU);
- the pages a rank holds are its share of the KV heads.

Rank 0 writes ``{"ok": bool, "checks": {name: bool}, "max_abs": {name: float}, ...}`` to ``--out``; the exit code is
non-zero when a check failed. CUDA ranks use NCCL, CPU ranks (``--device cpu``, the default without CUDA) gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's hf_sparse_kv

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Dense, Quest

CONFIG = {
    "vocab_size": 128,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ATOL = 1e-3  # float32: the row-parallel all-reduce sums the heads' partial outputs in another order
QUEST = {"budget": 48, "sink": 4, "window": 16}
PATCH = {"mode": "block", "dense_layers": (0,), "block_size": 16}


def build(path: str) -> None:
    """Save the tiny random Llama to ``path`` (rank 0 only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)


def load_tp(path: str, dtype: torch.dtype):
    """``from_pretrained(path, tp_plan="auto")``, spelled as transformers >= 5.17 prefers (``DistributedConfig``): each
    rank holds its share of the heads and of the MLP."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype
    ).eval()


def inputs(device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """One 200-token prompt, and a batch of a 160- and a 200-token prompt, the shorter one left-padded."""
    g = torch.Generator().manual_seed(1)
    one = torch.randint(3, CONFIG["vocab_size"], (1, 200), generator=g)
    batch = torch.randint(3, CONFIG["vocab_size"], (2, 200), generator=g)
    mask = torch.ones_like(batch)
    batch[0, :40], mask[0, :40] = CONFIG["pad_token_id"], 0
    return {
        "one": {"input_ids": one.to(device), "attention_mask": torch.ones_like(one).to(device)},
        "padded": {"input_ids": batch.to(device), "attention_mask": mask.to(device)},
    }


def greedy(model, batch: dict[str, torch.Tensor], policy=None, new_tokens: int = 24, merge: bool = False):
    """Greedy tokens ``[B, new_tokens]`` and logits ``[new_tokens, B, V]``; patched by ``policy`` while it runs
    (``None``: unpatched; ``merge``: with ``merge_projections=True``). Also returns the cache of a patched run
    (``None`` unpatched)."""
    cache = None
    kwargs = {}
    if policy is not None:
        patch_model(model, policy=policy, merge_projections=merge, **PATCH)
        cache = PagedKVCache(model.config, block_size=PATCH["block_size"])
        kwargs[cache_kwarg(model)] = cache
    try:
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                **kwargs,
            )
    finally:
        unpatch_model(model)
    return out.sequences[:, batch["input_ids"].shape[1] :].cpu(), torch.stack(out.scores).float().cpu(), cache


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` over the finite logits (``min_new_tokens`` sets the EOS logit to ``-inf``)."""
    finite = a.isfinite() & b.isfinite()
    return (a[finite] - b[finite]).abs().max().item() if bool((a.isfinite() == b.isfinite()).all()) else float("inf")


def local_kv_heads(cache: PagedKVCache) -> set[int]:
    """The KV head counts of the cache's paged layers (its pools are ``[NB, Hkv, BS, D]``)."""
    return {layer.k_pool.shape[1] for layer in cache.layers if hasattr(layer, "k_pool")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    from transformers import LlamaForCausalLM

    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path, src=0)  # every rank reads rank 0's folder
        if rank == 0:
            build(path[0])
        dist.barrier()
        tp = load_tp(path[0], torch.float32)
        single = LlamaForCausalLM.from_pretrained(path[0], dtype=torch.float32).to(device).eval()
        dist.barrier()  # rank 0's folder is removed when it leaves the block
    checks, max_abs = {}, {}
    for name, batch in inputs(device).items():
        plain_tokens, plain_logits, _ = greedy(tp, batch)
        dense_tokens, dense_logits, dense_cache = greedy(tp, batch, Dense())
        checks[f"{name}: dense TP == unpatched TP, tokens"] = torch.equal(dense_tokens, plain_tokens)
        max_abs[f"{name}: dense TP - unpatched TP"] = max_abs_diff(dense_logits, plain_logits)
        quest_tokens, quest_logits, quest_cache = greedy(tp, batch, Quest(**QUEST))
        ref_tokens, ref_logits, _ = greedy(single, batch, Quest(**QUEST))
        checks[f"{name}: quest TP == quest one device, tokens"] = torch.equal(quest_tokens, ref_tokens)
        max_abs[f"{name}: quest TP - quest one device"] = max_abs_diff(quest_logits, ref_logits)
        merged_tokens, merged_logits, _ = greedy(tp, batch, Quest(**QUEST), merge=True)
        checks[f"{name}: quest TP merged == quest TP, tokens"] = torch.equal(merged_tokens, quest_tokens)
        max_abs[f"{name}: quest TP merged - quest TP (dense-exact)"] = max_abs_diff(merged_logits, quest_logits)
        checks[f"{name}: quest differs from dense (the selection is sparse)"] = not torch.equal(
            quest_logits, dense_logits
        )
        checks[f"{name}: pages hold this rank's KV heads"] = local_kv_heads(quest_cache) == {
            CONFIG["num_key_value_heads"] // world
        }
        assert dense_cache is not None
    for key, value in max_abs.items():
        if "dense" in key:  # the dense rows, and merged against unmerged (the same arithmetic)
            checks[f"{key} <= {ATOL}"] = value <= ATOL
    ok = all(checks.values())
    oks = [None] * world
    dist.all_gather_object(oks, ok)
    if rank == 0:
        result = {"ok": all(oks), "world": world, "device": device.type, "checks": checks, "max_abs": max_abs}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    sys.exit(0 if all(oks) else 1)


if __name__ == "__main__":
    main()
