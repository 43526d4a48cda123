"""``block_topk``: block scores and their top-k in one Triton launch (the row's last program selects), against the
two launches it replaces and against ``reference.topk_indices`` of the same scores.

The fused kernel scores with the same code as ``block_scores``, so its selection must equal the top-k of the Triton
scores exactly; against the float32 reference's own scores a near-tie could fall either way, so the reference
comparison takes the reference's top-k of the kernel's scores (and, where no two scores are close, the reference's
``block_topk`` itself).
"""

from __future__ import annotations

import pytest
import torch

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R

triton = pytest.importorskip("triton")

from hf_sparse_kv.ops.triton.block_scores import block_scores
from hf_sparse_kv.ops.triton.block_topk import block_topk
from hf_sparse_kv.ops.triton.topk import topk_indices

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def case(B, H, G, D, BS, lens, seed, dtype=torch.float32):
    """Query, Quest metadata of a permuted pool, its table (one extra block), lengths."""
    g = torch.Generator().manual_seed(seed)
    MB = -(-max(lens) // BS) + 1
    NB = B * MB + 3
    a, b = torch.randn(NB, H, D, generator=g), torch.randn(NB, H, D, generator=g)
    c = {
        "q": torch.randn(B, H * G, D, generator=g).to(dtype),
        "kmin": torch.minimum(a, b).to(dtype),
        "kmax": torch.maximum(a, b).to(dtype),
        "kmean": torch.randn(NB, H, D, generator=g).to(dtype),
        "block_table": torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int(),
        "seq_lens": torch.tensor(lens).int(),
    }
    return {k: v.to(DEVICE) for k, v in c.items()}


def args_of(c, BS, method):
    return (c["q"], c["kmin"], c["kmax"], c["kmean"], c["block_table"], c["seq_lens"], BS, method)


def check(c, BS, method, k, counts=None, start=None, sink=0, window=None, **knobs):
    """The fused selection equals the two launches and the reference top-k of the kernel's scores."""
    a = args_of(c, BS, method)
    out = block_topk(*a, k, counts, start, sink, window, **knobs)
    scores = block_scores(*a, start, sink, window, knobs.get("block_m"), 4, knobs.get("tiles_per_program", 2))
    two = topk_indices(scores, k, counts)
    assert out.dtype == torch.int32 and out.shape == (*scores.shape[:2], k)
    assert torch.equal(out, two)
    assert torch.equal(out, R.topk_indices(scores, k, counts))
    return out


@pytest.mark.parametrize("method", ["quest", "mean"])
@pytest.mark.parametrize("G,BS,lens,k", [(1, 8, [100, 37], 5), (4, 16, [300, 17], 8), (3, 8, [64], 100)])
def test_equals_the_two_launches(method, G, BS, lens, k):
    """Several rows, several tile programs a row (``block_m=16``, one tile each), k below, at and above the table."""
    c = case(len(lens), 2, G, 32, BS, lens, seed=G + k)
    check(c, BS, method, k, block_m=16, tiles_per_program=1)


@pytest.mark.parametrize("tiles,block_m", [(1, 16), (2, 16), (3, 32), (8, 16)])
def test_programs_per_row(tiles, block_m):
    """One to ten programs a row (the last one to arrive selects; the interpreter runs them in order, the GPU in
    any), forced blocks, per-sequence counts, a freed block."""
    c = case(3, 2, 4, 32, 8, [1190, 411, 9], seed=tiles)
    c["block_table"][1, 3] = -1
    start = torch.tensor([0, 9, 0], dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([30, 12, 2], device=DEVICE)  # at least the forced blocks (no ties among the +inf)
    out = check(c, 8, "quest", 30, counts, start, 4, 40, block_m=block_m, tiles_per_program=tiles)
    assert (out[1] != 3).all()  # freed: never selected
    assert (out[2, :, 2:] == -1).all() and (out[1, :, 12:] == -1).all() and (out[1] >= 0).sum() == 24  # counts


def test_reference_block_topk():
    """``reference.block_topk`` is the reference top-k of the reference scores; the kernel agrees with it where the
    scores are far apart (float32, random metadata: no near-ties at these sizes)."""
    c = case(2, 2, 4, 32, 16, [500, 200], seed=11)
    start = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    a = args_of(c, 16, "quest")
    ref = R.block_topk(*a, 6, None, start, 4, 32)
    assert torch.equal(ref, R.topk_indices(R.block_scores(*a, start, 4, 32), 6))
    assert torch.equal(block_topk(*a, 6, None, start, 4, 32), ref)


def test_repeated_calls_and_the_unfused_path():
    """The counters are left at zero: a second call selects the same; ``fused=False`` and an empty table take the
    two launches."""
    c = case(2, 2, 2, 32, 8, [700, 90], seed=3)
    a = args_of(c, 8, "quest")
    first = block_topk(*a, 12, block_m=16, tiles_per_program=1)
    assert torch.equal(block_topk(*a, 12, block_m=16, tiles_per_program=1), first)
    assert torch.equal(block_topk(*a, 12, fused=False, block_m=16, tiles_per_program=1), first)
    empty = c["block_table"][:, :0]
    assert block_topk(*a[:4], empty, c["seq_lens"], 8, "quest", 4).eq(-1).all()


def test_bad_counts():
    c = case(2, 2, 2, 32, 8, [70, 90], seed=4)
    with pytest.raises(ValueError, match="counts must be"):
        block_topk(*args_of(c, 8, "quest"), 4, torch.tensor([1, 2, 3], device=DEVICE))


def test_the_op_namespaces():
    """Both backends' namespaces and the registered op give the reference's selection."""
    from hf_sparse_kv.ops.library import registered_ops

    c = case(2, 2, 4, 32, 16, [400, 150], seed=7)
    a = args_of(c, 16, "mean")
    counts = torch.tensor([5, 3], device=DEVICE)
    ref = R.block_topk(*a, 5, counts)
    for ops in (get_ops("triton", DEVICE), get_ops("reference", DEVICE), registered_ops("triton")):
        assert torch.equal(ops.block_topk(*a, 5, counts), ref)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the GPU's programs arrive in any order)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,lens,k", [(1, [131072], 512), (8, [32768] * 8, 128), (3, [20000, 7000, 33], 200)])
def test_cuda_equals_the_two_launches(dtype, B, lens, k):
    c = case(B, 8, 4, 128, 16, lens, seed=B, dtype=dtype)
    start = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    counts = torch.tensor([k - i for i in range(B)], device=DEVICE)
    for _ in range(3):  # repeated: the counters reset, the arrival order differs
        check(c, 16, "quest", k, counts, start, 4, 32)
