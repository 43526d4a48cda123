"""The custom ops of hf_sparse_kv.ops.library: schemas, fake implementations and results checked by
``torch.library.opcheck`` (what torch.compile relies on), and each registered op equal to its backend's function."""

import pytest
import torch

from hf_sparse_kv.ops import get_ops, reference
from hf_sparse_kv.ops import library as lib
from hf_sparse_kv.ops.reference import NEG_INF

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if DEVICE == "cuda" else [])
B, HQ, HKV, D, BS, NB, MB, R = 2, 4, 2, 16, 8, 8, 3, 4


def _inputs():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([20, 13], dtype=torch.int32, device=DEVICE)
    zeros = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    k_pool, v_pool = rnd(NB, HKV, BS, D), rnd(NB, HKV, BS, D)
    kmin, kmax, kmean = rnd(NB, HKV, D), rnd(NB, HKV, D), rnd(NB, HKV, D)
    names = ("q", "k_pool", "v_pool", "kmin", "kmax", "kmean", "table", "seq_lens", "start", "zeros")
    c = dict(zip(names, (rnd(B, HQ, D), k_pool, v_pool, kmin, kmax, kmean, table, seq_lens, zeros, zeros)))
    # the compressed-key selectors' inputs: compressed keys [NB, Hkv, BS, R], projection [Hkv, D, R], queries
    return {**c, "ckeys": rnd(NB, HKV, BS, R), "proj": rnd(HKV, D, R), "qp": rnd(B, HQ, R)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_ops_pass_opcheck_and_equal_the_backend(backend):
    c = _inputs()
    raw = get_ops(backend, DEVICE)
    q, kp, vp, t, n, st, z = c["q"], c["k_pool"], c["v_pool"], c["table"], c["seq_lens"], c["start"], c["zeros"]
    qp, ck = c["qp"], c["ckeys"]
    blocks = torch.tensor([[[0, 2], [1, -1]], [[0, 1], [-1, -1]]], dtype=torch.int32, device=DEVICE)
    tokens = reference.blocks_to_tokens(blocks, BS)
    mask = reference.selection_to_mask(blocks, "block", BS, 20, n, st, z, z)
    meta = (c["kmin"], c["kmax"], c["kmean"])
    scores = reference.block_scores(q, *meta, t, n, BS, "quest")
    cases = [
        (lib.decode_blocks_op, (q, kp, vp, t, n, st, blocks, z, z, 0.25, backend),
         raw.decode_blocks(q, kp, vp, t, n, st, blocks, z, z, 0.25)),
        (lib.decode_tokens_op, (q, kp, vp, t, n, st, tokens, z, z, 0.25, backend),
         raw.decode_tokens(q, kp, vp, t, n, st, tokens, z, z, 0.25)),
        (lib.decode_masked_op, (q, kp, vp, t, n, mask, 0.25, backend), raw.decode_masked(q, kp, vp, t, n, mask, 0.25)),
        (lib.block_scores_op, (q, *meta, t, n, BS, "quest", st, 4, 8, backend),
         raw.block_scores(q, *meta, t, n, BS, "quest", st, 4, 8)),
        (lib.block_shares_op, (q, *meta[:2], t, n, BS, 0.25, "mean", st, 4, 8, backend),
         raw.block_shares(q, *meta[:2], t, n, BS, 0.25, "mean", st, 4, 8)),
        (lib.token_scores_op, (q, kp, t, n, st, MB * BS, backend), raw.token_scores(q, kp, t, n, st, MB * BS)),
        (lib.oracle_block_scores_op, (q, kp, t, n, st, 0.25, MB * BS, backend),
         raw.oracle_block_scores(q, kp, t, n, st, 0.25, MB * BS)),
        (lib.topk_indices_op, (scores, 2, None, backend), raw.topk_indices(scores, 2)),
        (lib.topk_indices_op, (scores, 2, torch.tensor([2, 1], device=DEVICE), backend),
         reference.topk_indices(scores, 2, torch.tensor([2, 1], device=DEVICE))),
        (lib.projected_scores_op, (qp, ck, t, n, st, "token", 4, 8, None, backend),
         raw.projected_scores(qp, ck, t, n, st, "token", 4, 8)),
        (lib.projected_scores_op, (qp, ck, t, n, st, "block", 4, 8, None, backend),
         raw.projected_scores(qp, ck, t, n, st, "block", 4, 8)),
        (lib.projected_scores_op, (qp, ck, t, n, st, "block", 0, None, None, backend),
         raw.projected_scores(qp, ck, t, n, st, "block")),
        (lib.projected_scores_op, (q, ck, t, n, st, "token", 4, 8, c["proj"], backend),  # raw queries, projected
         raw.projected_scores(q, ck, t, n, st, "token", 4, 8, qproj=c["proj"])),
        (lib.candidate_scores_op, (q, kp, t, n, st, blocks, "token", 0, None, None, backend),
         raw.candidate_scores(q, kp, t, n, st, blocks)),
        (lib.candidate_scores_op, (q, kp, t, n, st, blocks, "block", 4, 8, None, backend),
         raw.candidate_scores(q, kp, t, n, st, blocks, reduce="block", sink=4, window=8)),
        (lib.candidate_scores_op, (q, kp, t, n, st, blocks, "mass", 0, None, 0.25, backend),
         raw.candidate_scores(q, kp, t, n, st, blocks, reduce="mass", scale=0.25)),
        (lib.candidate_scores_op, (q, kp, t, n, st, blocks, "head_mass", 0, None, 0.25, backend),  # [B, Hq, C]
         raw.candidate_scores(q, kp, t, n, st, blocks, reduce="head_mass", scale=0.25)),
    ]  # fmt: skip
    for op, args, want in cases:
        torch.library.opcheck(op, args)
        got = op(*args)
        assert got.shape == want.shape and got.dtype == want.dtype, op
        if got.is_floating_point():
            torch.testing.assert_close(got.masked_fill(got == NEG_INF, 0), want.masked_fill(want == NEG_INF, 0))
        else:
            assert torch.equal(got, want), op
    # candidate_mass from either mass form (G = 2 and G = 1): (mass, key), key +inf at forced and -inf at padding
    for lse in (cases[-1][2], cases[-2][2]):
        args = (lse, blocks, n, st, BS, 4, 8, backend)
        torch.library.opcheck(lib.candidate_mass_op, args)
        for got, want in zip(lib.candidate_mass_op(*args), raw.candidate_mass(*args[:-1])):
            assert got.shape == want.shape == blocks.shape and got.dtype == want.dtype == torch.float32
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_paged_write_writes_in_place_like_the_backend(backend):
    c = _inputs()
    pos0 = torch.tensor([20, 13], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=DEVICE)
    new = torch.randn(2, B, HKV, 1, D, device=DEVICE)
    tensors = [c[k].clone() for k in ("k_pool", "v_pool", "kmin", "kmax", "kmean")]
    torch.library.opcheck(lib.paged_write_op, (*[t.clone() for t in tensors], table, pos0, *new, backend))
    want = [t.clone() for t in tensors]
    get_ops(backend, DEVICE).paged_write(*want, table, pos0, *new)
    lib.registered_ops(backend).paged_write(*tensors, table, pos0, *new)
    for got, ref in zip(tensors, want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_projected_write_writes_in_place_like_the_backend(backend):
    """The compressed keys of positions ``[lo, hi)`` (a prefill's span, a decode token, nothing) in place, as the
    backend's function writes them; every other entry untouched."""
    c = _inputs()
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([3, 13], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([20, 13], dtype=torch.int32, device=DEVICE)  # sequence 1 writes nothing
    args = (c["k_pool"], c["proj"], table, lo, hi, 17)
    torch.library.opcheck(lib.projected_write_op, (c["ckeys"].clone(), *args, backend))
    want, got = c["ckeys"].clone(), c["ckeys"].clone()
    get_ops(backend, DEVICE).projected_write(want, *args)
    lib.registered_ops(backend).projected_write(got, *args)
    torch.testing.assert_close(got, want)
    changed = (got != c["ckeys"]).any(-1)  # [NB, Hkv, BS]
    assert changed.any(-1).any(-1).nonzero().flatten().tolist() == [0, 1, 2], "only sequence 0's blocks"
