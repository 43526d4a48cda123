"""The compressed-key selectors' ops (projected keys, candidate scores): Triton against the float32 reference, and
the reference against a plain loop over positions, on awkward shapes: GQA 1/3/4/8, lengths not multiples of the
block size, left padding (``start``), evicted blocks (table entry -1), empty and full selections."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_kv.ops import get_ops, library
from hf_sparse_kv.ops import reference as R
from hf_sparse_kv.ops.layout import forced_block_mask, forced_token_mask

triton = pytest.importorskip("triton")

from test_triton_ops import DEVICE, make_case, random_blocks

OPS = get_ops("triton", DEVICE)

SHAPES = [  # (B, H, G, D, BS, lens, starts)
    (1, 1, 1, 16, 8, [1], None),
    (2, 2, 3, 32, 16, [37, 70], [0, 5]),
    (3, 1, 4, 64, 16, [16, 33, 90], [0, 0, 17]),
    (2, 2, 8, 16, 32, [100, 65], [3, 0]),
]


def _evict(c, BS, seed=0):
    """Free one middle block of every sequence long enough (its table entry becomes -1)."""
    table = c["block_table"].clone()
    for b, n in enumerate(c["seq_lens"].tolist()):
        if -(-n // BS) >= 3:
            table[b, 1] = -1
    c["block_table"] = table


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
@pytest.mark.parametrize("evicted", [False, True])
@pytest.mark.parametrize("reduce", ["token", "block"])
@pytest.mark.parametrize("force", [False, True])
def test_projected_scores_match_reference(shape, evicted, reduce, force):
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    if evicted:
        _evict(c, BS)
    Rk = max(1, D // 8) + 1  # an awkward rank
    g = torch.Generator().manual_seed(1)
    NB = c["k_pool"].shape[0]
    ckeys = torch.randn(NB, H, BS, Rk, generator=g).to(DEVICE)
    qp = torch.randn(B, H * G, Rk, generator=g).to(DEVICE)
    args = (qp, ckeys, c["block_table"], c["seq_lens"], c["start"], reduce)
    kw = {"sink": 3, "window": 7} if force else {}
    ref = R.projected_scores(*args, **kw)
    out = OPS.projected_scores(*args, **kw)
    assert out.shape == ref.shape
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out == float("inf"), ref == float("inf"))
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
@pytest.mark.parametrize("reduce", ["token", "block"])
def test_projected_scores_project_the_queries_in_the_kernel(shape, reduce):
    """``qproj=``: the raw queries ``[B, Hq, D]`` in, projected inside the op; the same as projecting them first."""
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    _evict(c, BS)
    Rk = max(1, D // 8) + 1
    g = torch.Generator().manual_seed(5)
    ckeys = torch.randn(c["k_pool"].shape[0], H, BS, Rk, generator=g).to(DEVICE)
    qproj = torch.randn(H, D, Rk, generator=g).to(DEVICE)
    q = c["q"]
    qp = torch.einsum("bhgd,hdr->bhgr", q.view(B, H, G, D), qproj).reshape(B, H * G, Rk)
    args = (ckeys, c["block_table"], c["seq_lens"], c["start"], reduce, 3, 7)
    want = R.projected_scores(qp, *args)
    ref = R.projected_scores(q, *args, qproj=qproj)
    out = OPS.projected_scores(q, *args, qproj=qproj)
    for got in (ref, out):
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == float("inf"), want == float("inf"))
        fin = want.isfinite()
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["token", "block"])
@pytest.mark.parametrize("knobs", [(1, 1, 4), (2, 3, 2), (4, 2, 8), (16, 1, 4), (2, 100, 4)], ids=str)
def test_projected_scores_knobs_change_nothing(reduce, knobs):
    """Blocks per tile, tiles per program (a program walks several, with the next tile's table entries prefetched)
    and warps give the reference's scores over a long table, at a bf16 and an awkward rank."""
    block_m, tiles, warps = knobs
    B, H, G, D, BS = 3, 2, 3, 16, 8
    c = make_case(B, H, G, D, BS, [203, 61, 130], starts=[0, 9, 0])
    _evict(c, BS)
    g = torch.Generator().manual_seed(6)
    for Rk, dtype in ((5, torch.float32), (4, torch.bfloat16)):
        ckeys = torch.randn(c["k_pool"].shape[0], H, BS, Rk, generator=g).to(DEVICE).to(dtype)
        qp = torch.randn(B, H * G, Rk, generator=g).to(DEVICE)
        args = (qp, ckeys, c["block_table"], c["seq_lens"], c["start"], reduce, 2, 5)
        ref = R.projected_scores(*args)
        out = OPS.projected_scores(*args, block_m, tiles_per_program=tiles, num_warps=warps)
        assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out == float("inf"), ref == float("inf"))
        fin = ref.isfinite()
        torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_projected_scores_reference_is_the_loop():
    """The reference equals the definition: per position, max over the group of ``qp . ckey``; forced as layout."""
    B, H, G, D, BS = 2, 2, 3, 16, 8
    c = make_case(B, H, G, D, BS, [29, 12], starts=[2, 0])
    _evict(c, BS)
    Rk = 3
    ckeys = torch.randn(c["k_pool"].shape[0], H, BS, Rk).to(DEVICE)
    qp = torch.randn(B, H * G, Rk).to(DEVICE)
    table, lens, st = c["block_table"], c["seq_lens"], c["start"]
    tok = R.projected_scores(qp, ckeys, table, lens, st, "token", sink=2, window=3)
    blk = R.projected_scores(qp, ckeys, table, lens, st, "block", sink=2, window=3)
    MB = table.shape[1]
    ftok = forced_token_mask(lens, st, 2, 3, BS, MB * BS)
    fblk = forced_block_mask(lens, st, 2, 3, BS, MB)
    for b in range(B):
        for h in range(H):
            for lb in range(MB):
                phys = int(table[b, lb])
                live = phys >= 0 and lb * BS < int(lens[b])
                best = float("-inf")
                for t in range(BS):
                    p = lb * BS + t
                    ok = live and int(st[b]) <= p < int(lens[b])
                    want = float("-inf")
                    if ok:
                        want = max(float(qp[b, h * G + g] @ ckeys[phys, h, t]) for g in range(G))
                        best = max(best, want)
                        want = float("inf") if ftok[b, p] else want
                    assert tok[b, h, p].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
                want = (float("inf") if fblk[b, lb] else best) if live else float("-inf")
                assert blk[b, h, lb].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("span_kind", ["prefill", "decode", "padded", "empty"])
def test_projected_write_matches_reference_and_touches_only_its_positions(dtype, span_kind):
    B, H, D, BS, Rk = 3, 2, 32, 16, 5
    c = make_case(B, H, 1, D, BS, [70, 41, 16], dtype=dtype)
    g = torch.Generator().manual_seed(2)
    proj = torch.randn(H, D, Rk, generator=g).to(DEVICE)
    NB = c["k_pool"].shape[0]
    before = torch.randn(NB, H, BS, Rk, generator=g).to(DEVICE).to(dtype)
    if span_kind == "prefill":
        lo, hi, span = [0, 0, 0], [70, 41, 16], 70
    elif span_kind == "decode":
        lo, hi, span = [69, 40, 15], [70, 41, 16], 1
    elif span_kind == "padded":  # left padding: each sequence wrote fewer than span tokens
        lo, hi, span = [0, 0, 0], [70, 29, 5], 70
    else:  # nothing written for one sequence
        lo, hi, span = [60, 41, 3], [70, 41, 16], 13
    lo_t, hi_t = torch.tensor(lo, device=DEVICE), torch.tensor(hi, device=DEVICE)
    ref, out = before.clone(), before.clone()
    R.projected_write(ref, c["k_pool"], proj, c["block_table"], lo_t, hi_t, span)
    OPS.projected_write(out, c["k_pool"], proj, c["block_table"], lo_t, hi_t, span)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    want = before.clone()
    for b in range(B):
        for p in range(lo[b], hi[b]):
            phys = int(c["block_table"][b, p // BS])
            want[phys, :, p % BS] = torch.einsum("hd,hdr->hr", c["k_pool"][phys, :, p % BS].float(), proj).to(dtype)
    torch.testing.assert_close(ref.float(), want.float(), rtol=tol, atol=tol)


def _candidates(c, K, BS, seed):
    """``K`` random candidates per (sequence, head), or ``K = "all"``: every block of the table, ascending (a full
    selection; a shorter sequence's blocks past its end too), then a slot past the table and a padding slot."""
    if K != "all":
        return random_blocks(c, K, BS, seed=seed)
    B, MB = c["block_table"].shape
    H = c["k_pool"].shape[1]
    full = torch.tensor([*range(MB + 1), -1], dtype=torch.int32, device=DEVICE)  # MB: past the table
    return full.expand(B, H, MB + 2).contiguous()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
@pytest.mark.parametrize("evicted", [False, True])
@pytest.mark.parametrize("K", [0, 1, 3, 8, "all"])
@pytest.mark.parametrize("reduce", ["token", "block"])
@pytest.mark.parametrize("force", [False, True])
def test_candidate_scores_match_reference(shape, evicted, K, reduce, force):
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    if evicted:
        _evict(c, BS)
    blocks = _candidates(c, K, BS, seed=len(str(K)))
    C = blocks.shape[-1]
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
    kw = {"reduce": reduce, **({"sink": 3, "window": 7} if force else {})}
    ref = R.candidate_scores(*args, **kw)
    out = OPS.candidate_scores(*args, **kw)
    assert out.shape == ref.shape == ((B, H, C, BS) if reduce == "token" else (B, H, C))
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out == float("inf"), ref == float("inf"))
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
@pytest.mark.parametrize("K", [3, "all"])
def test_candidate_scores_reference_is_the_definition(shape, K):
    """Token form: each candidate token's exact score, as ``token_scores`` computes it, forced tokens ``+inf``
    (``forced_token_mask``) where valid. Block form: the max of the token form over the block, forced blocks
    (``forced_block_mask``, evicted or not) ``+inf``, padding ``-inf``: what TwoStageBlockTopK ranked before."""
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    _evict(c, BS)
    blocks = _candidates(c, K, BS, seed=2)
    C = blocks.shape[-1]
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
    table, seq_lens, st = c["block_table"], c["seq_lens"], c["start"]
    MB = table.shape[1]
    exact = R.candidate_scores(*args)
    dense = R.token_scores(c["q"], c["k_pool"], table, seq_lens, st)
    pos = R.blocks_to_tokens(blocks, BS).long().view(B, H, C, BS)
    L = dense.shape[-1]
    picked = dense.gather(2, pos.clamp(0, L - 1).view(B, H, -1)).view(B, H, C, BS)
    fin = exact.isfinite()
    assert torch.equal(fin, picked.isfinite() & (pos >= 0) & (pos < L))
    torch.testing.assert_close(exact[fin], picked[fin], rtol=1e-5, atol=1e-5)

    ftok = forced_token_mask(seq_lens, st, 3, 7, BS, MB * BS)
    ftok = ftok.gather(1, pos.clamp(0, MB * BS - 1).view(B, -1)).view(B, H, C, BS) & fin
    tok = R.candidate_scores(*args, sink=3, window=7)
    assert torch.equal(tok, exact.masked_fill(ftok, float("inf")))

    blk = R.candidate_scores(*args, reduce="block", sink=3, window=7)
    lb = blocks.long()
    slot = (lb >= 0) & (lb < MB)
    fblk = forced_block_mask(seq_lens, st, 3, 7, BS, MB)
    fblk = fblk.gather(1, lb.clamp(0, MB - 1).view(B, -1)).view(B, H, C) & slot
    want = exact.amax(-1).masked_fill(fblk, float("inf")).masked_fill(~slot, float("-inf"))
    assert torch.equal(blk, want)
    assert torch.equal(R.candidate_scores(*args, reduce="block"), exact.amax(-1).masked_fill(~slot, float("-inf")))


@pytest.mark.parametrize("reduce", ["token", "block", "mass", "head_mass"])
@pytest.mark.parametrize("knobs", [(2, 1, 4, 2), (4, 3, 2, 3), (8, 2, 8, 1), (2, 100, 4, 2)], ids=str)
def test_candidate_scores_knobs_change_nothing(reduce, knobs):
    """Candidates per tile, tiles per program (the next tile's candidates prefetched), warps and stages give the
    reference's scores, with float32 and bf16 keys (bf16 queries too on CUDA: the product on the tensor cores)."""
    block_c, tiles, warps, stages = knobs
    B, H, G, D, BS = 2, 2, 4, 32, 8
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        c = make_case(B, H, G, D, BS, [190, 77], starts=[5, 0], dtype=dtype)
        if DEVICE.type != "cuda":  # Triton's interpreter gets bf16 x bf16 tl.dot wrong (any kernel): fp32 queries
            c["q"] = c["q"].float()
        _evict(c, BS)
        blocks = random_blocks(c, 19, BS, seed=7)
        args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
        kw = {"reduce": reduce, "sink": 2, "window": 9} if "mass" not in reduce else {"reduce": reduce, "scale": 0.2}
        ref = R.candidate_scores(*args, **kw)
        out = OPS.candidate_scores(*args, block_c, tiles_per_program=tiles, num_warps=warps, num_stages=stages, **kw)
        assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out == float("inf"), ref == float("inf"))
        fin = ref.isfinite()
        torch.testing.assert_close(out[fin], ref[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
@pytest.mark.parametrize("evicted", [False, True])
@pytest.mark.parametrize("K", [0, 1, 3, 8, "all"])
@pytest.mark.parametrize("reduce", ["mass", "head_mass"])
def test_candidate_mass_forms_match_reference(shape, evicted, K, reduce):
    """Mass forms: each candidate's log-sum-exp of its tokens' scaled scores (``"mass"``: ``[B, Hkv, C]``, scores
    maxed over the group; ``"head_mass"``: ``[B, Hq, C]``, per query head), ``-inf`` for padding slots and for
    candidates without a valid token (past the end, before ``start``, evicted), never NaN (empty rows included)."""
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    if evicted:
        _evict(c, BS)
    blocks = _candidates(c, K, BS, seed=len(str(K)))
    C = blocks.shape[-1]
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
    ref = R.candidate_scores(*args, reduce=reduce, scale=0.37)
    out = OPS.candidate_scores(*args, reduce=reduce, scale=0.37)
    assert out.shape == ref.shape == ((B, H, C) if reduce == "mass" else (B, H * G, C))
    assert torch.equal(out.isinf(), ref.isinf()) and not (ref == float("inf")).any() and not out.isnan().any()
    fin = ref.isfinite()
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)
    if reduce == "head_mass":  # a candidate with no valid token has no mass for any head of its group
        mass = R.candidate_scores(*args, reduce="mass", scale=0.37)
        assert torch.equal(fin.view(B, H, G, C), mass.isfinite().unsqueeze(2).expand(B, H, G, C))
    if K == "all":
        assert fin.any() and (~fin).any()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
def test_candidate_mass_is_the_softmax_mass_of_the_token_form(shape):
    """``softmax`` over the candidates of the mass form is each block's share of the softmax of the token form's
    scaled scores over all the candidates' tokens (what TopPBlockTopK ranked before), ``0`` where a row has none."""
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    _evict(c, BS)
    for K in (0, 3, "all"):
        blocks = _candidates(c, K, BS, seed=5)
        C = blocks.shape[-1]
        args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
        exact = R.candidate_scores(*args)
        want = (exact.view(B, H, C * BS) * 0.37).softmax(-1).nan_to_num(0.0).view(B, H, C, BS).sum(-1)
        lse = R.candidate_scores(*args, reduce="mass", scale=0.37)
        torch.testing.assert_close(lse.softmax(-1).nan_to_num(0.0), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}G{s[2]}D{s[3]}BS{s[4]}")
def test_candidate_head_mass_is_each_heads_softmax_mass(shape):
    """``softmax`` over the candidates of the per-head mass form is each query head's share of the softmax of its
    own scaled scores (``scale * q_h . k``, computed here from the dense keys, no max over the group) over all the
    candidates' tokens, ``0`` where a row has none; with every block a candidate, the shares summed over each group
    are the oracle's block mass (``oracle_block_scores``)."""
    B, H, G, D, BS, lens, starts = shape
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    _evict(c, BS)
    table, seq_lens, st = c["block_table"], c["seq_lens"], c["start"]
    MB = table.shape[1]
    L = MB * BS
    keys = R.gather_dense(c["k_pool"], table, L).float()  # [B, H, L, D]
    logits = torch.einsum("bhgd,bhld->bhgl", c["q"].float().view(B, H, G, D), keys) * 0.37  # [B, H, G, L]
    for K in (0, 3, "all"):
        blocks = _candidates(c, K, BS, seed=5)
        C = blocks.shape[-1]
        args = (c["q"], c["k_pool"], table, seq_lens, st, blocks)
        valid = R.candidate_scores(*args).isfinite()  # [B, H, C, BS] the token form's valid positions
        pos = R.blocks_to_tokens(blocks, BS).long().clamp(0, L - 1).view(B, H, 1, C * BS).expand(B, H, G, C * BS)
        x = logits.gather(-1, pos).masked_fill(~valid.view(B, H, 1, C * BS), float("-inf"))
        want = x.softmax(-1).nan_to_num(0.0).view(B, H, G, C, BS).sum(-1).reshape(B, H * G, C)
        share = R.candidate_scores(*args, reduce="head_mass", scale=0.37).softmax(-1).nan_to_num(0.0)
        torch.testing.assert_close(share, want, rtol=1e-5, atol=1e-6)
        if K == "all":  # blocks 0..MB-1 in order, then a slot past the table and a padding slot
            oracle = R.oracle_block_scores(c["q"], c["k_pool"], table, seq_lens, st, 0.37, L)  # [B, H, MB]
            summed = share.view(B, H, G, C).sum(2)[..., :MB]
            live = oracle.isfinite()
            torch.testing.assert_close(summed[live], oracle[live], rtol=1e-5, atol=1e-6)
            assert (summed[~live] == 0).all() and (share[..., MB:] == 0).all()


@pytest.mark.parametrize("reduce", ["mass", "head_mass"])
def test_candidate_mass_refuses_a_window_or_no_scale(reduce):
    c = make_case(1, 1, 2, 16, 8, [20])
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], random_blocks(c, 2, 8, seed=0))
    for ops in (R, OPS):
        for kw in ({}, {"scale": 0.0}, {"scale": 0.5, "window": 4}):
            with pytest.raises(ValueError, match=reduce):
                ops.candidate_scores(*args, reduce=reduce, **kw)
        with pytest.raises(ValueError, match="reduce"):
            ops.candidate_scores(*args, reduce="sum")


def test_registered_selector_ops_compile_fullgraph_around_the_kernels():
    """What a static step calls (``hf_sparse_kv.ops.library.registered_ops``): the compressed keys' write of a
    decode token, the scores from them and the candidates' exact scores (every form, per-head mass included) under ``torch.compile(fullgraph=True)``
    (the Triton launchers stay outside the traced graph, as custom ops) give what the launchers give eagerly."""
    B, H, G, D, BS, lens, starts = SHAPES[1]
    c = make_case(B, H, G, D, BS, lens, starts=starts)
    Rk = 3
    g = torch.Generator().manual_seed(5)
    proj = torch.randn(H, D, Rk, generator=g).to(DEVICE)
    ckeys = torch.randn(c["k_pool"].shape[0], H, BS, Rk, generator=g).to(DEVICE)
    blocks = random_blocks(c, 3, BS, seed=6)
    lo = c["seq_lens"].long() - 1
    table, lens_t, st = c["block_table"], c["seq_lens"], c["start"]

    def step(ops, ckeys):
        ops.projected_write(ckeys, c["k_pool"], proj, table, lo, lo + 1, 1)
        qp = torch.einsum("bhgd,hdr->bhgr", c["q"].float().view(B, H, G, D), proj).reshape(B, H * G, Rk)
        token = ops.projected_scores(qp, ckeys, table, lens_t, st, "token", 3, 7)
        block = ops.projected_scores(c["q"], ckeys, table, lens_t, st, "block", 3, 7, qproj=proj)
        exact = ops.candidate_scores(c["q"], c["k_pool"], table, lens_t, st, blocks)
        best = ops.candidate_scores(c["q"], c["k_pool"], table, lens_t, st, blocks, reduce="block", sink=3, window=7)
        mass = ops.candidate_scores(c["q"], c["k_pool"], table, lens_t, st, blocks, reduce="mass", scale=0.37)
        heads = ops.candidate_scores(c["q"], c["k_pool"], table, lens_t, st, blocks, reduce="head_mass", scale=0.37)
        return token, block, exact, best, mass, heads

    want_c, got_c = ckeys.clone(), ckeys.clone()
    want = step(OPS, want_c)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(library.registered_ops("triton"), got_c)
    torch.testing.assert_close(got_c, want_c, rtol=0, atol=0)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels, larger shapes)")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("BS", [16, 64])
def test_cuda_selector_ops_large(dtype, BS):
    """Llama-3-8B-like heads (G 4, D 128, R 16) over 5000 and 9001 tokens, bf16/fp16 against the float32 reference
    (the queries projected before the scoring op or inside it; candidates per token and per block)."""
    B, H, G, D, Rk = 2, 8, 4, 128, 16
    c = make_case(B, H, G, D, BS, [5000, 9001], dtype=dtype, starts=[0, 7])
    _evict(c, BS)
    g = torch.Generator().manual_seed(3)
    proj = torch.randn(H, D, Rk, generator=g).to(DEVICE) / D**0.5
    NB = c["k_pool"].shape[0]
    ref_c, out_c = (torch.zeros(NB, H, BS, Rk, dtype=dtype, device=DEVICE) for _ in range(2))
    lo, hi = torch.zeros(B, dtype=torch.long, device=DEVICE), c["seq_lens"].long()
    R.projected_write(ref_c, c["k_pool"], proj, c["block_table"], lo, hi, 9001)
    OPS.projected_write(out_c, c["k_pool"], proj, c["block_table"], lo, hi, 9001)
    assert ((out_c.float() - ref_c.float()).norm() / ref_c.float().norm()) < 1e-2
    qp = torch.randn(B, H * G, Rk, generator=g).to(DEVICE)
    for reduce in ("token", "block"):
        args = (ref_c, c["block_table"], c["seq_lens"], c["start"], reduce, 4, 32)
        for queries, kw in ((qp, {}), (c["q"], {"qproj": proj})):  # projected before, or inside the kernel
            ref, out = R.projected_scores(queries, *args, **kw), OPS.projected_scores(queries, *args, **kw)
            assert torch.equal(out.isinf(), ref.isinf())
            fin = ref.isfinite()
            assert ((out[fin] - ref[fin]).norm() / ref[fin].norm()) < 1e-4
    blocks = random_blocks(c, 200, BS, seed=4)
    args = (c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], blocks)
    for kw in (
        {},
        {"reduce": "block", "sink": 4, "window": 32},
        {"reduce": "mass", "scale": D**-0.5},
        {"reduce": "head_mass", "scale": D**-0.5},
    ):
        ref, out = R.candidate_scores(*args, **kw), OPS.candidate_scores(*args, **kw)
        assert torch.equal(out.isinf(), ref.isinf())
        fin = ref.isfinite()
        assert ((out[fin] - ref[fin]).norm() / ref[fin].norm()) < 1e-2


def test_per_position_writes_skip_freed_blocks_and_positions_past_the_table():
    """The per-position state writes (projected keys, float8 codes and scales, product-quantization codes), Triton
    and reference, store exactly the positions of ``[lo, hi)`` that have a page: not those of a freed block (table
    entry -1), not those past the table, and nothing else (the reference once clamped such positions onto physical
    block 0 or the table's last block, writing over other pages)."""
    g = torch.Generator().manual_seed(7)
    NB, H, BS, D, R_, C = 12, 2, 16, 32, 8, 16
    table = torch.tensor([[3, 7, -1, 1, 9], [0, 2, 5, -1, -1]], dtype=torch.int32, device=DEVICE)
    lo = torch.tensor([5, 20], dtype=torch.long, device=DEVICE)
    hi = torch.tensor([70, 90], dtype=torch.long, device=DEVICE)  # sequence 1 runs past the table's 80 positions
    span = 70
    k_pool = torch.randn(NB, H, BS, D, generator=g).to(DEVICE)
    written = torch.zeros(NB, BS, dtype=torch.bool, device=DEVICE)
    for b in range(2):
        for p in range(int(lo[b]), int(hi[b])):
            if p // BS < table.shape[1] and table[b, p // BS] >= 0:
                written[table[b, p // BS], p % BS] = True
    proj = (torch.randn(H, D, R_, generator=g) / D**0.5).to(DEVICE)
    centres = torch.randn(H, D // 8, C, 8, generator=g).to(DEVICE)
    cases = {
        "projected": (torch.randn(NB, H, BS, R_, generator=g).to(DEVICE), lambda ops, st: ops.projected_write(
            st, k_pool, proj, table, lo, hi, span)),
        "fp8 codes": (torch.randint(0, 255, (NB, H, BS, D), generator=g, dtype=torch.uint8).to(DEVICE),
                      lambda ops, st: ops.fp8_write(st, k_pool, table, lo, hi, span, "codes")),
        "fp8 scales": (torch.rand(NB, H, BS, generator=g).to(DEVICE),
                       lambda ops, st: ops.fp8_write(st, k_pool, table, lo, hi, span, "scales")),
        "pq codes": (torch.randint(0, C, (NB, H, BS, D // 8), generator=g, dtype=torch.uint8).to(DEVICE),
                     lambda ops, st: ops.pq_write(st, k_pool, centres, table, lo, hi, span)),
    }  # fmt: skip
    for name, (old, write) in cases.items():
        want, got = old.clone(), old.clone()
        write(get_ops("reference", DEVICE), want)
        write(OPS, got)
        changed = (want != old).reshape(NB, H, BS, -1).any(-1).any(1)  # [NB, BS]: a slot any head's entry moved in
        assert not (changed & ~written).any(), f"{name}: the reference wrote a slot outside [lo, hi)'s pages"
        assert changed[written].float().mean() > 0.9, name  # (a random old entry may equal its new one)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5, msg=name)
