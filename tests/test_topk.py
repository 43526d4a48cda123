"""``topk_indices``'s two Triton methods against ``reference.topk_indices``: one program per row (``"row"``) and a
row spread over chunks (``"chunks"``, forced to many small chunks so that the tiny CPU shapes run the multi-program
path, its prefix over chunks and its ties across chunks).

``torch.topk`` leaves the order of ties at the threshold unspecified, the kernels take the lowest indices: rows with
ties are compared with the reference on scores whose ties were broken by index (:func:`by_index`).
"""

from __future__ import annotations

import pytest
import torch

from hf_sparse_kv.ops import reference as R

triton = pytest.importorskip("triton")

from hf_sparse_kv.ops.triton.topk import TOPK_MAX_N, chunk_tiles, row_tiles, topk_indices, topk_method

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")
METHODS = [("row", None), ("chunks", 4)]  # (the interpreter runs a program in ~0.2 s for "row", ~0.07 s for "chunks")


def by_index(s: torch.Tensor) -> torch.Tensor:
    """Integer-valued scores with ties broken toward the lower index (``+inf`` kept above every finite score, ``-inf``
    kept): the reference then selects what the kernels must (ties at the threshold go to the lowest indices)."""
    d = s.double().masked_fill(s == INF, 1e9)
    return d - torch.arange(s.shape[-1], dtype=torch.float64, device=s.device) * 1e-7


def scores(shape, seed, ties=False, neg_inf=0.2, pos_inf=0.0):
    """Random scores ``shape`` (integers in [-3, 3] when ``ties``), a share of ``-inf`` (and ``+inf``) lanes, the
    last three lanes ``-inf`` (past the sequence), row 0 all ``-inf`` (nothing to select)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
    s[torch.rand(shape, generator=g) < neg_inf] = -INF
    s[torch.rand(shape, generator=g) < pos_inf] = INF
    s[..., -3:] = -INF
    s.view(-1, shape[-1])[0] = -INF
    return s.to(DEVICE)


@pytest.mark.parametrize("chunks", [4, 16])
@pytest.mark.parametrize(
    "shape,k", [((2, 2, 100), 7), ((1, 10), 16), ((1, 300), 1), ((2, 257), 64), ((1, 1025), 1025), ((2, 33), 40)]
)
def test_random_rows_equal_the_reference(chunks, shape, k):
    """No ties: ``"chunks"`` equal to the reference exactly (k = 1, k = N, k > N, N just above a power of two, a
    chunk of one lane). ``"row"`` on random rows: tests/test_triton_ops.py."""
    s = scores(shape, k, pos_inf=0.05)
    s[..., 1] = -0.0
    out = topk_indices(s, k, method="chunks", chunks=chunks)
    assert out.dtype == torch.int32 and out.shape == (*shape[:-1], k)
    assert torch.equal(out, R.topk_indices(s, k))


@pytest.mark.parametrize("method,chunks", METHODS)
@pytest.mark.parametrize("shape,k", [((2, 2, 200), 30), ((2, 130), 1), ((1, 77), 70), ((1, 1, 513), 200)])
def test_ties_go_to_the_lowest_indices(method, chunks, shape, k):
    """Integer scores: every threshold is a tie spread over many chunks; ``+inf`` ties too."""
    s = scores(shape, 7 * k, ties=True, pos_inf=0.05)
    out = topk_indices(s, k, method=method, chunks=chunks)
    assert torch.equal(out, R.topk_indices(by_index(s), k))


@pytest.mark.parametrize("gap", ["sign", "exponent", "last bit", "tie"])
def test_row_early_stop_selects_what_all_steps_select(gap):
    """``"row"`` stops its radix select once exactly k keys lie above its threshold: the k-th and the next key apart
    in the sign (the first step), in the exponent, in the last mantissa bit (all 16 steps) or tied at the threshold
    (never exactly k above: all steps, ties by index). Equal to the reference and to the kernel without the stop."""
    k = 5
    g = torch.Generator().manual_seed(len(gap))
    base = torch.rand(3, 40, generator=g) + 1.0  # in [1, 2): one exponent
    kth = {"sign": 0.5, "exponent": 3.0, "last bit": 8.0, "tie": 8.0}[gap]
    top = 10.0 + torch.rand(3, k - 1, generator=g)  # the k - 1 largest
    s = base if gap != "sign" else -base
    s[:, 7 : 7 + k - 1] = top
    s[:, 20] = kth  # the k-th largest
    if gap == "last bit":
        s[:, 30] = torch.nextafter(torch.tensor(kth), torch.tensor(0.0))  # one ulp below the k-th
    if gap == "tie":
        s[:, 3] = kth  # ties at the threshold, one before and one after the k-th's index
    s = s.to(DEVICE)
    out = topk_indices(s, k, method="row")
    assert torch.equal(out, R.topk_indices(s, k)) and torch.equal(out, topk_indices(s, k, method="row", early=False))


@pytest.mark.parametrize("method,chunks", METHODS)
@pytest.mark.parametrize("ties", [False, True])
def test_per_sequence_counts(method, chunks, ties):
    """``counts [B]``: sequence b keeps min(k, counts[b]) entries (0, fewer than k, k, more than k), on the device."""
    s = scores((4, 2, 90), 3, ties=ties, neg_inf=0.3)
    counts = torch.tensor([5, 0, 25, 40], device=DEVICE)
    out = topk_indices(s, 25, counts, method=method, chunks=chunks)
    assert torch.equal(out, R.topk_indices(by_index(s) if ties else s, 25, counts))
    assert (out[1] == -1).all() and (out[0, :, 5:] == -1).all() and (out[2:, 1] >= 0).all()


def test_all_equal_rows_and_empty_shapes():
    """Every lane tied (the whole row is one bin at every digit), a row of zeros of one chunk, and no work at all."""
    for method, chunks in METHODS:
        s = torch.zeros(2, 70, device=DEVICE)
        s[1, 10:] = 5.0
        out = topk_indices(s, 12, method=method, chunks=chunks)
        assert out[0].tolist() == list(range(12)) and out[1].tolist() == list(range(10, 22)), method
        assert topk_indices(torch.zeros(3, 0, device=DEVICE), 4, method=method).tolist() == [[-1] * 4] * 3
        assert topk_indices(s, 0, method=method).shape == (2, 0)
        assert topk_indices(torch.zeros(0, 5, device=DEVICE), 2, method=method).shape == (0, 2)


@pytest.mark.parametrize("N,k", [(8193, 512), (TOPK_MAX_N + 1, 600)])
def test_long_rows(N, k):
    """A 128K prompt's blocks (8193: both methods, the default chunking of 33 chunks a row) and a row longer than
    ``"row"`` holds (``"auto"`` takes ``"chunks"``, here in 4 chunks of 8192; before, such rows went to
    ``torch.topk``)."""
    s = scores((1, 2, N), N, pos_inf=0.001)
    ref = R.topk_indices(s, k)
    assert torch.equal(topk_indices(s, k, chunks=None if N <= TOPK_MAX_N else 3), ref)
    if N <= TOPK_MAX_N:
        assert torch.equal(topk_indices(s, k, method="row"), ref)
    else:
        with pytest.raises(ValueError, match="at most"):
            topk_indices(s, k, method="row")


def test_the_choice_depends_on_the_shape_only():
    assert topk_method(8193) == "row" and topk_method(131073) == "chunks"
    assert topk_method(2048) == "row" and topk_method(24576) == "row" and topk_method(24577) == "chunks"
    assert chunk_tiles(8, 8193) == (256, 33)  # 264 programs on 132 SMs
    assert chunk_tiles(64, 8193) == (2048, 5) and chunk_tiles(8, 131073) == (2048, 65)
    assert chunk_tiles(1, 100, chunks=8) == (16, 7) and chunk_tiles(1, 5, chunks=8) == (16, 1)
    assert row_tiles(8193) == (8192, 16)


def test_bad_arguments():
    s = torch.zeros(2, 3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="method"):
        topk_indices(s, 2, method="heap")
    with pytest.raises(ValueError, match="counts"):
        topk_indices(s, 2, torch.tensor([1, 2, 3], device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels, full-size rows)")
@pytest.mark.parametrize("rows,N,k", [(8, 8193, 512), (8, 8209, 512), (64, 32769, 2048), (8, 131073, 8192)])
def test_cuda_full_size(rows, N, k):
    """The benchmark's shapes, compiled: both methods (and the lanes-per-chunk extremes) on random and tied rows,
    with per-sequence counts (0, below k, k, above k)."""
    methods = [("chunks", None), ("chunks", -(-N // 256)), ("chunks", -(-N // 2048))]
    methods += [("row", None)] if N <= TOPK_MAX_N else []
    s = scores((rows // 2, 2, N), rows + N, pos_inf=0.0005, neg_inf=0.05)
    ties = scores((rows // 2, 2, N), rows + N, ties=True, pos_inf=0.0005, neg_inf=0.05)
    counts = torch.tensor([(0, k // 3, k, k + 5)[b % 4] for b in range(rows // 2)], device=DEVICE)
    want, want_ties = R.topk_indices(s, k), R.topk_indices(by_index(ties), k)
    want_counts = R.topk_indices(by_index(ties), k, counts)
    for method, chunks in methods:
        assert torch.equal(topk_indices(s, k, method=method, chunks=chunks), want), (method, chunks)
        assert torch.equal(topk_indices(ties, k, method=method, chunks=chunks), want_ties), (method, chunks)
        assert torch.equal(topk_indices(ties, k, counts, method=method, chunks=chunks), want_counts), (method, chunks)
