"""Triton kernels against the plain-PyTorch reference (``hf_sparse_kv.ops.reference``).

Without CUDA the kernels run through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), so
the CPU shapes are tiny; on CUDA the same tests run, plus larger bf16/fp16 shapes (``test_cuda_*``).
Errors are relative: ``||out - ref|| / ||ref||`` against the float32 reference.
"""

from __future__ import annotations

import pytest
import torch

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R

triton = pytest.importorskip("triton")

from hf_sparse_kv.ops.triton import block_decode, merge, token_decode
from hf_sparse_kv.ops.triton.topk import row_tiles, topk_indices

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
OPS = get_ops("triton", DEVICE)
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels, larger shapes)")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    assert not out.isnan().any(), "NaN in output"
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def check_lse(lse: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not lse.isnan().any()
    assert torch.equal(lse.isneginf(), ref.isneginf()), "empty rows differ"
    fin = ref.isfinite()
    if fin.any():
        assert rel_err(lse[fin], ref[fin]) < tol


def make_case(B, H, G, D, BS, lens, dtype=torch.float32, starts=None, excl=None, seed=0):
    """A paged cache with a random block table (a permutation of the pool), random data, the validity tensors."""
    g = torch.Generator().manual_seed(seed)
    MB = -(-max(lens) // BS) + 1
    NB = B * MB + 3
    c = {
        "q": torch.randn(B, H * G, D, generator=g),
        "k_pool": torch.randn(NB, H, BS, D, generator=g),
        "v_pool": torch.randn(NB, H, BS, D, generator=g),
        "block_table": torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int(),
        "seq_lens": torch.tensor(lens).int(),
        "start": torch.tensor(starts or [0] * B).int(),
        "ex_lo": torch.tensor([e[0] for e in excl] if excl else [0] * B).int(),
        "ex_hi": torch.tensor([e[1] for e in excl] if excl else [0] * B).int(),
    }
    c = {k: v.to(DEVICE) for k, v in c.items()}
    for k in ("q", "k_pool", "v_pool"):
        c[k] = c[k].to(dtype)
    return c


def random_blocks(c, K, BS, seed=0, pad_frac=0.3):
    """``[B, Hkv, K]`` distinct logical blocks per (sequence, head), a random share replaced by -1, shuffled."""
    g = torch.Generator().manual_seed(seed)
    B = c["block_table"].shape[0]
    H = c["k_pool"].shape[1]
    out = torch.full((B, H, K), -1, dtype=torch.int32)
    for b in range(B):
        nblk = -(-int(c["seq_lens"][b]) // BS)
        for h in range(H):
            pick = torch.randperm(nblk, generator=g)[:K]
            keep = torch.rand(len(pick), generator=g) >= pad_frac
            out[b, h, : len(pick)] = torch.where(keep, pick, -1).int()
            out[b, h] = out[b, h, torch.randperm(K, generator=g)]
    return out.to(DEVICE)


def decode_args(c, sel):
    return (c["q"], c["k_pool"], c["v_pool"], c["block_table"], c["seq_lens"], c["start"], sel, c["ex_lo"], c["ex_hi"])


# (G, BS, D, lens, starts, exclusion) - lengths not multiples of BS, left padding, an exclusion interval
CASES = [
    (1, 8, 16, [45, 30], [0, 3], [(0, 0), (10, 17)]),
    (3, 16, 32, [97, 18], [5, 0], [(20, 40), (0, 0)]),
    (4, 8, 32, [64, 33], [0, 0], [(0, 0), (8, 9)]),
    (8, 16, 16, [100, 71], [2, 17], [(30, 50), (0, 0)]),
    (2, 16, 80, [61, 20], [0, 4], [(0, 0), (5, 9)]),  # a head dim that is no power of two (Phi-2, Pythia-2.8B: 80)
]


@pytest.mark.parametrize("G,BS,D,lens,starts,excl", CASES)
@pytest.mark.parametrize(
    "knobs",
    [{}, {"block_n": 16, "num_splits": 3}, {"block_n": 32, "num_splits": 1}, {"block_n": 16, "prefetch": False}],
)
def test_decode_blocks(G, BS, D, lens, starts, excl, knobs):
    c = make_case(2, 2, G, D, BS, lens, starts=starts, excl=excl, seed=G)
    sel = random_blocks(c, 5, BS, seed=G)
    ref, ref_lse = R.decode_blocks(*decode_args(c, sel), 0.3, return_lse=True)
    if knobs:
        out, lse = block_decode.decode_blocks_fwd(*decode_args(c, sel), 0.3, **knobs)
    else:
        out, lse = OPS.decode_blocks(*decode_args(c, sel), 0.3, return_lse=True)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-5
    check_lse(lse, ref_lse, 1e-5)


def test_decode_blocks_unmerged_partials():
    """``merge=False`` (the benchmark's stage-1 timing) returns the splits' partials; merged, they are the output."""
    c = make_case(2, 2, 3, 16, 8, [70, 33], seed=5)
    sel = random_blocks(c, 6, 8, seed=5)
    out, lse = block_decode.decode_blocks_fwd(*decode_args(c, sel), 0.3, block_n=16, num_splits=3)
    o_part, lse_part = block_decode.decode_blocks_fwd(*decode_args(c, sel), 0.3, block_n=16, num_splits=3, merge=False)
    assert o_part.shape == (2, 6, 3, 16) and lse_part.shape == (2, 6, 3)
    merged, merged_lse = merge.merge_partials_fwd(o_part, lse_part)
    assert rel_err(merged, out) < 1e-6
    check_lse(merged_lse, lse, 1e-6)


@pytest.mark.parametrize("G,BS,D,lens,starts,excl", CASES)
@pytest.mark.parametrize("knobs", [{}, {"block_n": 16, "num_splits": 2}, {"block_n": 16, "prefetch": False}])
def test_decode_tokens(G, BS, D, lens, starts, excl, knobs):
    c = make_case(2, 2, G, D, BS, lens, starts=starts, excl=excl, seed=G + 10)
    g = torch.Generator().manual_seed(G)
    # random positions: duplicates, past the sequence (invalid), -1 anywhere
    tok = torch.randint(-1, max(lens) + 3, (2, 2, 37), generator=g).int().to(DEVICE)
    ref, ref_lse = R.decode_tokens(*decode_args(c, tok), 0.3, return_lse=True)
    if knobs:
        out, lse = token_decode.decode_tokens_fwd(*decode_args(c, tok), 0.3, **knobs)
    else:
        out, lse = OPS.decode_tokens(*decode_args(c, tok), 0.3, return_lse=True)
    assert rel_err(out, ref) < 1e-5
    check_lse(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("G", [1, 3])
def test_decode_empty_selection(G):
    c = make_case(2, 2, G, 16, 8, [40, 9], starts=[0, 4])
    for fn, sel in ((OPS.decode_blocks, torch.full((2, 2, 4), -1)), (OPS.decode_tokens, torch.full((2, 2, 20), -1))):
        out, lse = fn(*decode_args(c, sel.int().to(DEVICE)), 0.3, return_lse=True)
        assert not out.isnan().any() and not lse.isnan().any()
        assert (out == 0).all() and lse.isneginf().all()
    # a selection whose blocks are all past the sequence or inside the exclusion interval: also empty
    c["ex_lo"], c["ex_hi"] = torch.tensor([0, 0]).int().to(DEVICE), torch.tensor([16, 16]).int().to(DEVICE)
    sel = torch.tensor([[[0, 1, -1], [5, 0, 1]], [[2, 3, 4], [2, -1, 5]]]).int().to(DEVICE)
    out, lse = OPS.decode_blocks(*decode_args(c, sel), 0.3, return_lse=True)
    ref, ref_lse = R.decode_blocks(*decode_args(c, sel), 0.3, return_lse=True)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5
    check_lse(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_decode_full_selection_is_dense(G):
    lens, BS = [77, 50], 16
    c = make_case(2, 2, G, 32, BS, lens, starts=[0, 6], seed=G)
    MB = c["block_table"].shape[1]
    sel = torch.arange(MB).int().expand(2, 2, MB).contiguous().to(DEVICE)
    out = OPS.decode_blocks(*decode_args(c, sel), 0.25)
    tok_out = OPS.decode_tokens(*decode_args(c, R.blocks_to_tokens(sel, BS)), 0.25)
    mask = R.selection_to_mask(sel, "block", BS, max(lens), c["seq_lens"], c["start"], c["ex_lo"], c["ex_hi"])
    dense = R.decode_masked(c["q"], c["k_pool"], c["v_pool"], c["block_table"], c["seq_lens"], mask, 0.25)
    assert rel_err(out, dense) < 1e-5
    assert rel_err(tok_out, dense) < 1e-5


def test_merge_partials():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(2, 3, 7, 24, generator=g).to(DEVICE)
    lse = (3 * torch.randn(2, 3, 7, generator=g)).to(DEVICE)
    lse[0, 0] = float("-inf")  # every split empty
    lse[1, 2, 1:5] = float("-inf")  # some empty
    out, tot = OPS.merge_partials(o, lse)
    ref, ref_tot = R.merge_partials(o, lse)
    assert out.shape == ref.shape and tot.shape == ref_tot.shape and out.dtype == o.dtype
    assert rel_err(out, ref) < 1e-5
    assert (out[0, 0] == 0).all()
    check_lse(tot, ref_tot, 1e-5)
    # one split is the identity; many splits take the chunked path
    out1, _ = merge.merge_partials(o[:, :, :1], lse[:, :, :1])
    assert rel_err(out1[1:], o[1:, :, 0]) < 1e-6
    o2, l2 = torch.randn(3, 150, 16, generator=g).to(DEVICE), torch.randn(3, 150, generator=g).to(DEVICE)
    assert rel_err(merge.merge_partials(o2, l2)[0], R.merge_partials(o2, l2)[0]) < 1e-5


def make_meta(NB, H, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(NB, H, D, generator=g), torch.randn(NB, H, D, generator=g)
    meta = torch.minimum(a, b), torch.maximum(a, b), torch.randn(NB, H, D, generator=g)
    return [m.to(DEVICE, dtype) for m in meta]


@pytest.mark.parametrize("method", ["quest", "mean"])
@pytest.mark.parametrize("G,BS", [(1, 8), (3, 16), (4, 8), (8, 16)])
def test_block_scores(method, G, BS):
    c = make_case(2, 2, G, 32, BS, [100, 37], seed=G)
    kmin, kmax, kmean = make_meta(c["k_pool"].shape[0], 2, 32, seed=G)
    args = (c["q"], kmin, kmax, kmean, c["block_table"], c["seq_lens"], BS, method)
    out, ref = OPS.block_scores(*args), R.block_scores(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    assert rel_err(out[fin], ref[fin]) < 1e-5


@pytest.mark.parametrize("sink,window", [(4, 8), (0, 1), (40, 0), (3, 200)])
def test_block_scores_force_sink_window_and_current_block(sink, window):
    c = make_case(3, 2, 4, 32, 16, [100, 37, 16], seed=sink + window)
    kmin, kmax, kmean = make_meta(c["k_pool"].shape[0], 2, 32, seed=3)
    start = torch.tensor([0, 5, 0], dtype=torch.int32, device=DEVICE)
    table = c["block_table"].clone()
    table[0, 2] = -1  # a freed block inside the window is never forced back
    args = (c["q"], kmin, kmax, kmean, table, c["seq_lens"], 16, "quest", start, sink, window)
    out, ref = OPS.block_scores(*args), R.block_scores(*args)
    assert torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf())
    assert ref[:, :, 0].isposinf().any() or sink == 0  # the sink's block
    for b, n in enumerate([100, 37, 16]):
        assert ref[b, :, (n - 1) // 16].isposinf().all()  # the current block
    fin = ref.isfinite()
    assert rel_err(out[fin], ref[fin]) < 1e-5


@pytest.mark.parametrize("tiles,stages", [(2, 1), (3, 2), (8, 3)])
def test_block_scores_walking_several_tiles_a_program(tiles, stages):
    """``tiles_per_program`` tiles of ``block_m`` blocks a program, the loop pipelined or not: the same scores as the
    reference (a table of 150 blocks: the last program's tiles partly or wholly past the table), forced blocks too."""
    c = make_case(2, 2, 4, 32, 8, [1190, 411], seed=tiles)
    kmin, kmax, kmean = make_meta(c["k_pool"].shape[0], 2, 32, seed=tiles)
    start = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    for method in ("quest", "mean"):
        args = (c["q"], kmin, kmax, kmean, c["block_table"], c["seq_lens"], 8, method, start, 4, 40)
        ref = R.block_scores(*args)
        out = OPS.block_scores(*args, block_m=16, tiles_per_program=tiles, num_stages=stages)
        assert torch.equal(out.isposinf(), ref.isposinf()) and torch.equal(out.isneginf(), ref.isneginf())
        fin = ref.isfinite()
        assert rel_err(out[fin], ref[fin]) < 1e-5


def test_block_scores_of_freed_blocks_are_neg_inf():
    c = make_case(2, 2, 4, 32, 16, [100, 37], seed=5)
    kmin, kmax, kmean = make_meta(c["k_pool"].shape[0], 2, 32, seed=5)
    table = c["block_table"].clone()
    table[0, 1:4] = -1  # freed by an evicting policy
    table[1, 0] = -1
    for method in ("quest", "mean"):
        args = (c["q"], kmin, kmax, kmean, table, c["seq_lens"], 16, method)
        out, ref = OPS.block_scores(*args), R.block_scores(*args)
        assert out[0, :, 1:4].isneginf().all() and out[1, :, 0].isneginf().all()
        assert torch.equal(out.isneginf(), ref.isneginf())
        fin = ref.isfinite()
        assert rel_err(out[fin], ref[fin]) < 1e-5


@pytest.mark.parametrize(
    "shape,k", [((2, 3, 50), 7), ((1, 2, 10), 16), ((4, 100), 100), ((2, 2, 300), 1), ((3, 40), 20), ((2, 130), 64)]
)
@pytest.mark.parametrize("early", [True, False])
def test_topk_indices(shape, k, early):
    """Rows of 40 and 130 are held as two tiles (32 + 16, 128 + 16 lanes); the others as one. With or without the
    radix select's early stop."""
    g = torch.Generator().manual_seed(k)
    s = torch.randn(shape, generator=g)
    s[..., -3:] = float("-inf")  # past the sequence
    s.view(-1, shape[-1])[0] = float("-inf")  # a row with nothing to select
    s[..., 1] = -0.0
    s[..., 2] = float("inf")  # a forced block
    s = s.to(DEVICE)
    out = topk_indices(s, k, early=early)
    assert out.dtype == torch.int32 and out.shape == (*shape[:-1], k)
    assert torch.equal(out, R.topk_indices(s, k))


def test_topk_row_tiles():
    assert row_tiles(16) == (16, 0) and row_tiles(1) == (16, 0) and row_tiles(2048) == (2048, 0)
    assert row_tiles(8193) == (8192, 16) and row_tiles(12000) == (8192, 4096)
    assert row_tiles(16000) == (16384, 0)  # two tiles (8192 + 8192) would save nothing


def test_topk_ties_across_tiles():
    """Ties at the threshold straddling the two tiles go to the lowest indices, as one tile does."""
    s = torch.zeros(2, 40)  # tiles of 32 + 16 lanes
    s[0, 30:36] = 1.0  # six tied at the threshold, two in the first tile
    s[1, ::5] = 2.0
    s = s.to(DEVICE)
    assert topk_indices(s, 4)[0].tolist() == [30, 31, 32, 33]
    assert torch.equal(topk_indices(s, 4), topk_indices(s, 4, split=False))
    assert topk_indices(s, 9)[1].tolist() == [0, 1, 5, 10, 15, 20, 25, 30, 35]


@pytest.mark.parametrize("BS,T,pos0", [(8, 1, [13, 0]), (16, 1, [15, 16]), (8, 7, [3, 30]), (16, 37, [0, 21])])
def test_paged_write(BS, T, pos0):
    c = make_case(2, 2, 1, 16, BS, [80, 80])
    meta = make_meta(c["k_pool"].shape[0], 2, 16)
    g = torch.Generator().manual_seed(T)
    k_new, v_new = (torch.randn(2, 2, T, 16, generator=g).to(DEVICE) for _ in range(2))
    mine = [t.clone() for t in (c["k_pool"], c["v_pool"], *meta)]
    ref = [t.clone() for t in (c["k_pool"], c["v_pool"], *meta)]
    p0 = torch.tensor(pos0).int().to(DEVICE)
    OPS.paged_write(*mine, c["block_table"], p0, k_new, v_new)
    R.paged_write(*ref, c["block_table"], p0, k_new, v_new)
    for name, a, b in zip(("k_pool", "v_pool", "kmin", "kmax", "kmean"), mine, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("kept", [(), ("kmin", "kmax"), ("kmean",)])
def test_paged_write_of_a_cache_keeping_part_of_the_metadata(kept):
    """Metadata the cache does not keep comes as a one-element placeholder: the kernel and the reference write the
    same K / V and the kept metadata as a write of all three does, and leave the placeholders alone."""
    c = make_case(2, 2, 1, 16, 8, [80, 80])
    meta = make_meta(c["k_pool"].shape[0], 2, 16)
    g = torch.Generator().manual_seed(5)
    k_new, v_new = (torch.randn(2, 2, 7, 16, generator=g).to(DEVICE) for _ in range(2))
    p0 = torch.tensor([3, 30]).int().to(DEVICE)
    full = [t.clone() for t in (c["k_pool"], c["v_pool"], *meta)]
    R.paged_write(*full, c["block_table"], p0, k_new, v_new)
    names = ("kmin", "kmax", "kmean")
    for write in (OPS.paged_write, R.paged_write):
        part = [c["k_pool"].clone(), c["v_pool"].clone()]
        part += [m.clone() if n in kept else m.new_zeros(1) for n, m in zip(names, meta)]  # the cache's placeholder
        write(*part, c["block_table"], p0, k_new, v_new)
        for name, a, b in zip(("k_pool", "v_pool", *names), part, full):
            if name in ("k_pool", "v_pool", *kept):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (write, name)
            else:
                assert a.shape == (1,) and a.item() == 0, (write, name)  # left alone


# ------------------------------------------------------------------------------------------------ CUDA, larger


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D,BS,G", [(128, 16, 4), (128, 64, 3), (64, 32, 3), (256, 16, 8), (128, 8, 1), (64, 256, 2)])
def test_cuda_decode(dtype, D, BS, G):
    lens = [5000, 3001, 777]
    c = make_case(3, 4, G, D, BS, lens, dtype=dtype, starts=[0, 100, 3], excl=[(64, 1000), (0, 0), (0, 0)])
    sel = random_blocks(c, 48, BS, pad_frac=0.2)
    ref, ref_lse = R.decode_blocks(*decode_args(c, sel), D**-0.5, return_lse=True)
    out, lse = OPS.decode_blocks(*decode_args(c, sel), D**-0.5, return_lse=True)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    check_lse(lse, ref_lse, TOL[dtype])
    tok = R.blocks_to_tokens(sel, BS)
    out_t, lse_t = OPS.decode_tokens(*decode_args(c, tok), D**-0.5, return_lse=True)
    assert rel_err(out_t, ref) < TOL[dtype]
    check_lse(lse_t, ref_lse, TOL[dtype])


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["quest", "mean"])
def test_cuda_block_scores(dtype, method):
    BS, D = 16, 128
    c = make_case(2, 8, 4, D, BS, [20000, 7000], dtype=dtype)
    kmin, kmax, kmean = make_meta(c["k_pool"].shape[0], 8, D, dtype=dtype)
    args = (c["q"], kmin, kmax, kmean, c["block_table"], c["seq_lens"], BS, method)
    out, ref = OPS.block_scores(*args), R.block_scores(*args)
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    assert rel_err(out[fin], ref[fin]) < TOL[dtype]


@cuda_only
@pytest.mark.parametrize("N,k", [(8192, 512), (16384, 1024), (2048, 128), (777, 1000), (8200, 512), (20000, 1250)])
def test_cuda_topk_indices(N, k):
    s = torch.randn(3, 8, N, device=DEVICE)
    s[0, :, N // 2 :] = float("-inf")
    s[1, :, :4] = float("inf")
    assert torch.equal(topk_indices(s, k), R.topk_indices(s, k))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("BS,T", [(16, 1), (64, 1), (32, 1000)])
def test_cuda_paged_write(dtype, BS, T):
    D = 128
    c = make_case(2, 8, 1, D, BS, [3000, 3000], dtype=dtype)
    meta = make_meta(c["k_pool"].shape[0], 8, D, dtype=dtype)
    k_new, v_new = (torch.randn(2, 8, T, D, device=DEVICE, dtype=dtype) for _ in range(2))
    mine = [t.clone() for t in (c["k_pool"], c["v_pool"], *meta)]
    ref = [t.clone() for t in (c["k_pool"], c["v_pool"], *meta)]
    p0 = torch.tensor([1234, 7]).int().to(DEVICE)
    OPS.paged_write(*mine, c["block_table"], p0, k_new, v_new)
    R.paged_write(*ref, c["block_table"], p0, k_new, v_new)
    for name, a, b in zip(("k_pool", "v_pool", "kmin", "kmax", "kmean"), mine, ref):
        # pools: the same bytes; metadata: float32 sums in another order, then rounded to the metadata dtype
        assert torch.equal(a, b) if name.endswith("pool") else rel_err(a, b) < TOL[dtype], name


def test_each_triton_op_runs_with_its_tensors_device_current(monkeypatch):
    """Triton launches on the current CUDA device: every op of the Triton namespace (``get_ops`` and the custom ops
    take them from it) makes its tensors' device current first, unless it already is, and leaves CPU tensors (the
    interpreter) alone. On the CPU: a tensor that says it lives on ``cuda:1``, ``cuda:0`` current, the device switch
    recorded."""
    import contextlib

    from hf_sparse_kv.ops import _OP_NAMES, REFERENCE_ONLY
    from hf_sparse_kv.ops import triton as triton_ops

    class OnCuda(torch.Tensor):
        index = 1

        @property
        def device(self):
            return torch.device("cuda", self.index)

    switched, seen = [], []

    @contextlib.contextmanager
    def device(d):
        switched.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    launcher = triton_ops.on_its_device(lambda *a, **k: seen.append(list(switched)) or "done")
    on1 = torch.zeros(2).as_subclass(OnCuda)
    assert launcher(on1, 3, block=4) == "done" and seen[-1] == [torch.device("cuda", 1)]
    assert launcher(k=on1) == "done" and len(switched) == 2  # a tensor given by name decides as well
    OnCuda.index = 0
    assert launcher(on1) == "done" and len(switched) == 2  # already current: no switch
    assert launcher(torch.zeros(2), torch.zeros(1)) == "done" and len(switched) == 2  # the interpreter's CPU tensors
    wrapped = [name for name in _OP_NAMES if name not in REFERENCE_ONLY]
    assert wrapped and all(hasattr(getattr(triton_ops, name), "__wrapped__") for name in wrapped)
