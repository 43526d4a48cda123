"""Property sweeps of every sparse-KV op: the Triton kernels against the reference, and the ops against each other.

Each test draws its cases from a seeded ``random.Random`` (deterministic in CI): random batch, GQA ratio (1..8,
3/5/6 included), block size (8/16/32), head dim (16/32/64), lengths that are rarely multiples of the block size,
left padding (``start``), exclusion intervals, block tables with ``-1`` past each sequence's blocks, selections
with ``-1`` padding, variable counts, duplicates and positions past the sequence, and the kernels' tuning knobs.
On failure the case's parameters are in the assertion message; rerun one with ``-k "name and seed"``.

Shapes are tiny: on the CPU the kernels run in Triton's interpreter (``tests/conftest.py``).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import reference as R

pytest.importorskip("triton")

from hf_sparse_kv.ops.triton import block_decode, token_decode

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
T_OPS = get_ops("triton", DEVICE)
TOL = 1e-5  # float32, relative
GS = (1, 2, 3, 4, 5, 6, 7, 8)
BSS = (8, 16, 32)
DS = (16, 32, 64)


# ------------------------------------------------------------------------------------------------------ helpers


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` per row of the last dim, the worst row (a zero reference row must be matched
    exactly)."""
    out, ref = (
        out.float().flatten(0, -2) if out.dim() > 1 else out.float()[None],
        (ref.float().flatten(0, -2) if ref.dim() > 1 else ref.float()[None]),
    )
    assert not out.isnan().any(), "NaN in output"
    num = (out - ref).norm(dim=-1)
    den = ref.norm(dim=-1)
    err = torch.where(den > 0, num / den.clamp(min=1e-30), num * 1e30)
    return err.max().item() if err.numel() else 0.0


def check_lse(lse: torch.Tensor, ref: torch.Tensor, msg: str) -> None:
    assert not lse.isnan().any(), msg
    assert torch.equal(lse.isneginf(), ref.isneginf()), f"empty rows differ: {msg}"
    fin = ref.isfinite()
    if fin.any():
        err = ((lse[fin] - ref[fin]).abs() / ref[fin].abs().clamp(min=1.0)).max().item()
        assert err < TOL, f"lse err {err}: {msg}"


def draw_paged(rng: random.Random, max_blocks: int = 5) -> dict:
    """A random paged layer: pools with a shuffled block table (``-1`` past each sequence), validity tensors."""
    B, H, G = rng.randint(1, 3), rng.choice((1, 2)), rng.choice(GS)
    BS, D = rng.choice(BSS), rng.choice(DS)
    lens = [rng.randint(1, max_blocks * BS) for _ in range(B)]
    nblk = [-(-n // BS) for n in lens]
    MB = max(nblk) + rng.randint(0, 2)  # the table may be wider than any sequence needs
    NB = sum(nblk) + rng.randint(0, 4)
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(rng.randrange(2**31))).tolist()
    table = torch.full((B, MB), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        table[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    starts, ex_lo, ex_hi = [], [], []
    for n in lens:
        starts.append(0 if rng.random() < 0.5 else rng.randint(0, n))  # start == n: nothing valid
        kind = rng.random()
        if kind < 0.4:
            lo = hi = 0
        elif kind < 0.9:
            lo = rng.randint(0, n)
            hi = rng.randint(lo, n + BS)
        else:  # an inverted interval is empty
            hi = rng.randint(0, n)
            lo = hi + rng.randint(1, 5)
        ex_lo.append(lo)
        ex_hi.append(hi)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    c = {
        "q": torch.randn(B, H * G, D, generator=g),
        "k_pool": torch.randn(NB, H, BS, D, generator=g),
        "v_pool": torch.randn(NB, H, BS, D, generator=g),
        "block_table": table,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "start": torch.tensor(starts, dtype=torch.int32),
        "ex_lo": torch.tensor(ex_lo, dtype=torch.int32),
        "ex_hi": torch.tensor(ex_hi, dtype=torch.int32),
    }
    c = {k: v.to(DEVICE) for k, v in c.items()}
    strided = rng.random() < 0.3
    if strided:  # the layouts the attention passes: q a view of [B, Hq, 1, D], pools and table inside larger tensors
        c["q"] = torch.stack([c["q"], torch.randn_like(c["q"])], 2)[:, :, 0]
        for name in ("k_pool", "v_pool"):  # a block stride larger than H * BS * D, a storage offset
            big = torch.randn(NB + 1, H + 1, BS, D, device=DEVICE)
            big[1:, :H] = c[name]
            c[name] = big[1:, :H]
        wide = torch.full((B, MB + 3), 7, dtype=torch.int32, device=DEVICE)
        wide[:, 1 : MB + 1] = c["block_table"]
        c["block_table"] = wide[:, 1 : MB + 1]
        c["seq_lens"] = c["seq_lens"].long()
    c.update(B=B, H=H, G=G, BS=BS, D=D, MB=MB, nblk=nblk, lens=lens, scale=rng.choice((D**-0.5, 0.3, 1.0)))
    c["strided"] = strided
    return c


def describe(c: dict, **extra) -> str:
    keys = ("B", "H", "G", "BS", "D", "MB", "lens", "strided")
    info = {k: c[k] for k in keys}
    info.update(start=c["start"].tolist(), ex=list(zip(c["ex_lo"].tolist(), c["ex_hi"].tolist())), **extra)
    return ", ".join(f"{k}={v}" for k, v in info.items())


def draw_blocks(rng: random.Random, c: dict, distinct: bool) -> torch.Tensor:
    """``[B, H, K]`` logical blocks: distinct blocks in use, ``-1`` anywhere; unless ``distinct``, also duplicates
    and blocks past the sequence (inside the table)."""
    K = rng.choice((0, 1, rng.randint(1, c["MB"] + 2)))
    out = torch.full((c["B"], c["H"], K), -1, dtype=torch.int32)
    for b in range(c["B"]):
        for h in range(c["H"]):
            if distinct:
                pool = list(range(c["nblk"][b]))
                rng.shuffle(pool)
                row = pool[:K]
            else:
                row = [rng.randrange(c["MB"]) for _ in range(K)]
            row = [x if rng.random() > 0.25 else -1 for x in row]
            row += [-1] * (K - len(row))
            rng.shuffle(row)
            out[b, h] = torch.tensor(row, dtype=torch.int32)
    return out.to(DEVICE)


def draw_tokens(rng: random.Random, c: dict, distinct: bool) -> torch.Tensor:
    """``[B, H, T]`` token positions: ``-1`` anywhere; unless ``distinct``, duplicates and positions past the
    sequence (up to the table's end)."""
    L = max(c["lens"])
    T = rng.choice((0, 1, rng.randint(1, 2 * L)))
    out = torch.full((c["B"], c["H"], T), -1, dtype=torch.int32)
    for b in range(c["B"]):
        for h in range(c["H"]):
            if distinct:
                pool = list(range(c["lens"][b]))
                rng.shuffle(pool)
                row = pool[:T]
            else:
                row = [rng.randrange(-1, c["MB"] * c["BS"]) for _ in range(T)]
            row = [x if rng.random() > 0.2 else -1 for x in row]
            row += [-1] * (T - len(row))
            rng.shuffle(row)
            out[b, h] = torch.tensor(row, dtype=torch.int32)
    return out.to(DEVICE)


def draw_knobs(rng: random.Random) -> dict:
    return {
        "block_n": rng.choice((None, 16, 32, 64)),
        "num_splits": rng.choice((None, 1, 2, 3, 5)),
        "prefetch": rng.random() < 0.7,
    }


def args(c: dict, sel: torch.Tensor) -> tuple:
    keys = ("q", "k_pool", "v_pool", "block_table", "seq_lens", "start")
    return (*(c[k] for k in keys), sel, c["ex_lo"], c["ex_hi"], c["scale"])


def mask_of(c: dict, sel: torch.Tensor, kind: str) -> torch.Tensor:
    L = max(c["lens"])
    return R.selection_to_mask(sel, kind, c["BS"], L, c["seq_lens"], c["start"], c["ex_lo"], c["ex_hi"])


def masked(c: dict, mask: torch.Tensor) -> torch.Tensor:
    return R.decode_masked(c["q"], c["k_pool"], c["v_pool"], c["block_table"], c["seq_lens"], mask, c["scale"])


# -------------------------------------------------------------------------------------------- decode: Triton vs ref


@pytest.mark.parametrize("seed", range(40))
def test_decode_blocks_triton_matches_reference(seed):
    rng = random.Random(1000 + seed)
    c = draw_paged(rng)
    sel = draw_blocks(rng, c, distinct=rng.random() < 0.5)
    knobs = draw_knobs(rng)
    msg = describe(c, K=sel.shape[-1], knobs=knobs, sel=sel.tolist())
    ref, ref_lse = R.decode_blocks(*args(c, sel), return_lse=True)
    out, lse = block_decode.decode_blocks_fwd(*args(c, sel), **knobs)
    assert out.shape == ref.shape and out.dtype == ref.dtype, msg
    err = rel_err(out, ref)
    assert err < TOL, f"err {err}: {msg}"
    check_lse(lse, ref_lse, msg)


@pytest.mark.parametrize("seed", range(40))
def test_decode_tokens_triton_matches_reference(seed):
    rng = random.Random(2000 + seed)
    c = draw_paged(rng)
    tok = draw_tokens(rng, c, distinct=rng.random() < 0.5)
    knobs = draw_knobs(rng)
    msg = describe(c, T=tok.shape[-1], knobs=knobs)
    ref, ref_lse = R.decode_tokens(*args(c, tok), return_lse=True)
    out, lse = token_decode.decode_tokens_fwd(*args(c, tok), **knobs)
    assert out.shape == ref.shape and out.dtype == ref.dtype, msg
    err = rel_err(out, ref)
    assert err < TOL, f"err {err}: {msg}"
    check_lse(lse, ref_lse, msg)


# ------------------------------------------------------------------------------ the three modes, both backends


@pytest.mark.parametrize("seed", range(35))
def test_block_selection_same_in_every_mode(seed):
    """decode_masked(selection_to_mask) == decode_tokens(blocks_to_tokens) == decode_blocks, reference and Triton."""
    rng = random.Random(3000 + seed)
    c = draw_paged(rng)
    sel = draw_blocks(rng, c, distinct=True)
    msg = describe(c, sel=sel.tolist())
    tok = R.blocks_to_tokens(sel, c["BS"])
    mask = mask_of(c, sel, "block")
    assert torch.equal(mask, mask_of(c, tok, "token")), msg
    oracle = masked(c, mask)
    outs = {
        "ref block": R.decode_blocks(*args(c, sel)),
        "ref token": R.decode_tokens(*args(c, tok)),
        "triton block": T_OPS.decode_blocks(*args(c, sel)),
        "triton token": T_OPS.decode_tokens(*args(c, tok)),
    }
    for name, out in outs.items():
        err = rel_err(out, oracle)
        assert err < TOL, f"{name} vs mask: err {err}: {msg}"


@pytest.mark.parametrize("seed", range(20))
def test_token_selection_same_in_mask_and_token_modes(seed):
    rng = random.Random(4000 + seed)
    c = draw_paged(rng)
    tok = draw_tokens(rng, c, distinct=True)
    msg = describe(c, T=tok.shape[-1])
    oracle = masked(c, mask_of(c, tok, "token"))
    for name, fn in (("ref", R.decode_tokens), ("triton", T_OPS.decode_tokens)):
        err = rel_err(fn(*args(c, tok)), oracle)
        assert err < TOL, f"{name} token vs mask: err {err}: {msg}"


@pytest.mark.parametrize("seed", range(8))
def test_full_selection_is_dense_attention(seed):
    """Every block selected, no exclusion: all modes equal plain softmax attention over ``[start, len)``."""
    rng = random.Random(4500 + seed)
    c = draw_paged(rng)
    c["ex_lo"] = c["ex_hi"] = torch.zeros_like(c["seq_lens"])
    sel = torch.arange(c["MB"], dtype=torch.int32, device=DEVICE).expand(c["B"], c["H"], -1).contiguous()
    L = max(c["lens"])
    keys = R.gather_dense(c["k_pool"], c["block_table"], L)
    values = R.gather_dense(c["v_pool"], c["block_table"], L)
    q = c["q"].view(c["B"], c["H"], c["G"], c["D"])
    logits = torch.einsum("bhgd,bhld->bhgl", q, keys) * c["scale"]
    pos = torch.arange(L, device=DEVICE)
    ok = (pos >= c["start"].view(-1, 1)) & (pos < c["seq_lens"].view(-1, 1))  # [B, L]
    p = logits.masked_fill(~ok.view(c["B"], 1, 1, L), float("-inf")).softmax(-1).nan_to_num(0.0)
    dense = torch.einsum("bhgl,bhld->bhgd", p, values).reshape(c["B"], -1, c["D"])
    msg = describe(c)
    for name, out in (
        ("ref", R.decode_blocks(*args(c, sel))),
        ("triton", T_OPS.decode_blocks(*args(c, sel))),
        ("triton token", T_OPS.decode_tokens(*args(c, R.blocks_to_tokens(sel, c["BS"])))),
    ):
        err = rel_err(out, dense)
        assert err < TOL, f"{name}: err {err}: {msg}"


# ---------------------------------------------------------------------------------------------------- merge


def split_last(rng: random.Random, sel: torch.Tensor) -> list[torch.Tensor]:
    """Cut ``sel [..., K]`` into 1..4 consecutive pieces (some possibly empty)."""
    K = sel.shape[-1]
    cuts = sorted(rng.randint(0, K) for _ in range(rng.randint(0, 3)))
    bounds = [0, *cuts, K]
    return [sel[..., a:b].contiguous() for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(20))
def test_merge_of_split_selection_equals_single_pass(seed):
    """Decode pieces of one selection separately, merge by log-sum-exp: the single pass's output and lse."""
    rng = random.Random(5000 + seed)
    c = draw_paged(rng)
    kind = rng.choice(("block", "token"))
    sel = draw_blocks(rng, c, distinct=False) if kind == "block" else draw_tokens(rng, c, distinct=False)
    fn_r = R.decode_blocks if kind == "block" else R.decode_tokens
    fn_t = T_OPS.decode_blocks if kind == "block" else T_OPS.decode_tokens
    pieces = split_last(rng, sel)
    msg = describe(c, kind=kind, pieces=[p.shape[-1] for p in pieces])
    ref, ref_lse = fn_r(*args(c, sel), return_lse=True)
    for name, fn, merge in (("ref", fn_r, R.merge_partials), ("triton", fn_t, T_OPS.merge_partials)):
        parts = [fn(*args(c, p), return_lse=True) for p in pieces]
        o = torch.stack([p[0] for p in parts], -2)  # [B, Hq, S, D]
        lse = torch.stack([p[1] for p in parts], -1)  # [B, Hq, S]
        out, tot = merge(o, lse)
        err = rel_err(out, ref)
        assert err < TOL, f"{name}: err {err}: {msg}"
        check_lse(tot, ref_lse, f"{name}: {msg}")


@pytest.mark.parametrize("seed", range(12))
def test_merge_partials_triton_matches_reference(seed):
    rng = random.Random(5500 + seed)
    g = torch.Generator().manual_seed(seed)
    lead = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]  # no leading dim: see test_merge_partials_1d
    S, D = rng.choice((1, 2, 3, 7, 70)), rng.choice((8, 16, 24, 64, 128))
    o = torch.randn(*lead, S, D, generator=g)
    lse = 5 * torch.randn(*lead, S, generator=g)
    lse[torch.rand(lse.shape, generator=g) < 0.3] = float("-inf")
    o, lse = o.to(DEVICE), lse.to(DEVICE)
    out, tot = T_OPS.merge_partials(o, lse)
    ref, ref_tot = R.merge_partials(o, lse)
    msg = f"lead={lead}, S={S}, D={D}"
    assert out.shape == ref.shape and tot.shape == ref_tot.shape, msg
    assert rel_err(out, ref) < TOL, msg
    check_lse(tot, ref_tot, msg)


# ------------------------------------------------------------------------------------------------- paged write


def recomputed_metadata(k_pool, table, lens):
    """min / max / mean of each block in use over its filled prefix, from the pool itself: dict phys -> 3 tensors."""
    BS = k_pool.shape[2]
    meta = {}
    for b, n in enumerate(lens):
        for lb in range(-(-n // BS)):
            fill = min(n - lb * BS, BS)
            keys = k_pool[int(table[b, lb]), :, :fill].float()  # [H, fill, D]
            meta[int(table[b, lb])] = (keys.amin(1), keys.amax(1), keys.mean(1))
    return meta


@pytest.mark.parametrize("seed", range(25))
def test_paged_write_sequence_matches_recomputation(seed):
    """A random sequence of appends (prefill chunks, then single tokens) from random offsets, both backends: the pool
    holds exactly what was written, other rows are untouched, and each touched block's min/max/mean is that of its
    filled prefix (rows already in the block before the first write included)."""
    rng = random.Random(6000 + seed)
    B, H, BS, D = rng.randint(1, 3), rng.choice((1, 2)), rng.choice(BSS), rng.choice(DS)
    chunks = [rng.randint(1, 3 * BS) for _ in range(rng.randint(1, 2))] + [1] * rng.randint(0, 3)
    if rng.random() < 0.2:
        chunks.insert(0, 0)  # an empty write is a no-op
    pos0 = [rng.choice((0, rng.randint(0, 2 * BS))) for _ in range(B)]
    ends = [p + sum(chunks) for p in pos0]
    MB = -(-max(ends) // BS)
    NB = B * MB + 2
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int()
    pools = [torch.randn(NB, H, BS, D, generator=g) for _ in range(2)] + [torch.randn(NB, H, D, generator=g)] * 3
    pools = [t.clone().to(DEVICE) for t in pools]
    new = [(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)) for T in chunks]
    table = table.to(DEVICE)
    msg = f"B={B}, H={H}, BS={BS}, D={D}, chunks={chunks}, pos0={pos0}"

    results = {}
    for name, ops in (("ref", R), ("triton", T_OPS)):
        state = [t.clone() for t in pools]
        p = torch.tensor(pos0, dtype=torch.int32, device=DEVICE)
        for k_new, v_new in new:
            # a non-contiguous k_new (a transposed view) must be read right too
            k_in = k_new.to(DEVICE).transpose(1, 2).contiguous().transpose(1, 2) if rng.random() < 0.5 else k_new
            ops.paged_write(*state, table, p, k_in.to(DEVICE), v_new.to(DEVICE))
            p = p + k_new.shape[2]
        results[name] = state

    k_all = torch.cat([k for k, _ in new], 2)  # [B, H, sum T, D]
    v_all = torch.cat([v for _, v in new], 2)
    for name, (k_pool, v_pool, kmin, kmax, kmean) in results.items():
        expect_k, expect_v = pools[0].clone(), pools[1].clone()
        for b in range(B):
            for i in range(k_all.shape[2]):
                pos = pos0[b] + i
                phys, off = int(table[b, pos // BS]), pos % BS
                expect_k[phys, :, off] = k_all[b, :, i]
                expect_v[phys, :, off] = v_all[b, :, i]
        assert torch.equal(k_pool, expect_k), f"{name} k_pool: {msg}"
        assert torch.equal(v_pool, expect_v), f"{name} v_pool: {msg}"
        touched = set()
        for b in range(B):
            if ends[b] > pos0[b]:
                touched |= {int(table[b, lb]) for lb in range(pos0[b] // BS, (ends[b] - 1) // BS + 1)}
        meta = recomputed_metadata(k_pool, table, ends)
        for phys in range(NB):
            got = (kmin[phys], kmax[phys], kmean[phys])
            if phys in touched:
                for what, a, e in zip(("min", "max", "mean"), got, meta[phys]):
                    assert torch.allclose(a, e, rtol=1e-6, atol=1e-6), f"{name} {what} of block {phys}: {msg}"
            else:
                for what, a, e in zip(("min", "max", "mean"), got, pools[2:]):
                    assert torch.equal(a, e[phys]), f"{name} untouched {what} of block {phys} changed: {msg}"


@pytest.mark.parametrize("seed", range(5))
def test_reference_paged_write_drops_negative_positions(seed):
    """The reference takes ``pos0 < 0`` (left padding at prefill): only positions >= 0 are stored."""
    rng = random.Random(6500 + seed)
    B, H, BS, D, T = 2, 2, rng.choice(BSS), 16, rng.randint(5, 40)
    pads = [rng.randint(0, T - 1), 0]
    g = torch.Generator().manual_seed(seed)
    MB = -(-T // BS)
    table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
    k_new, v_new = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    padded = [torch.zeros(B * MB, H, BS, D) for _ in range(2)] + [torch.zeros(B * MB, H, D) for _ in range(3)]
    R.paged_write(*padded, table, -torch.tensor(pads), k_new, v_new)
    for b in range(B):
        unpadded = [torch.zeros(MB, H, BS, D) for _ in range(2)] + [torch.zeros(MB, H, D) for _ in range(3)]
        R.paged_write(*unpadded, table[:1], torch.zeros(1, dtype=torch.int32), k_new[b : b + 1, :, pads[b] :],
                      v_new[b : b + 1, :, pads[b] :])  # fmt: skip
        rows = table[b].long()
        for a, e in zip(padded, unpadded):
            assert torch.equal(a[rows], e), f"BS={BS}, T={T}, pads={pads}"


# ---------------------------------------------------------------------------------------------- scores, top-k


@pytest.mark.parametrize("seed", range(25))
def test_block_scores_triton_matches_reference_and_bounds_tokens(seed):
    """Triton's block scores equal the reference's; Quest's score bounds every token's ``q . k`` in the block and the
    mean score is the group max of the mean ``q . k`` (metadata from paged_write)."""
    rng = random.Random(7000 + seed)
    c = draw_paged(rng, max_blocks=8)
    meta = [torch.zeros(c["k_pool"].shape[0], c["H"], c["D"], device=DEVICE) for _ in range(3)]
    zero = torch.zeros_like(c["seq_lens"])
    R.refresh_metadata(c["k_pool"], *meta, c["block_table"], zero, c["seq_lens"])
    msg = describe(c)
    L = max(c["lens"])
    keys = R.gather_dense(c["k_pool"], c["block_table"], L).float()  # [B, H, L, D]
    q = c["q"].view(c["B"], c["H"], c["G"], c["D"])
    qk = torch.einsum("bhgd,bhld->bhgl", q, keys)  # [B, H, G, L]
    for method in ("quest", "mean"):
        a = (c["q"], *meta, c["block_table"], c["seq_lens"], c["BS"], method)
        ref, out = R.block_scores(*a), T_OPS.block_scores(*a)
        assert out.shape == ref.shape == (c["B"], c["H"], c["MB"]), msg
        assert torch.equal(out.isneginf(), ref.isneginf()), f"{method}: {msg}"
        fin = ref.isfinite()
        err = ((out[fin] - ref[fin]).abs() / ref[fin].abs().clamp(min=1.0)).max().item() if fin.any() else 0.0
        assert err < TOL, f"{method}: err {err}: {msg}"
        for b, n in enumerate(c["lens"]):
            for lb in range(c["MB"]):
                if lb >= c["nblk"][b]:
                    assert ref[b, :, lb].isneginf().all(), f"{method}: block {lb} past seq {b}: {msg}"
                    continue
                s = qk[b, :, :, lb * c["BS"] : min(n, (lb + 1) * c["BS"])]  # [H, G, fill]
                if method == "quest":
                    assert (ref[b, :, lb] >= s.amax((1, 2)) - 1e-4).all(), f"quest bound, block {lb}: {msg}"
                else:
                    torch.testing.assert_close(ref[b, :, lb], s.mean(-1).amax(1), rtol=1e-5, atol=1e-5, msg=msg)


@pytest.mark.parametrize("seed", range(10))
def test_token_and_oracle_scores(seed):
    """token_scores is the group max of ``q . k`` on ``[start, len)``; oracle_block_scores sums to the group size per
    (sequence, head) with anything to attend, and is the per-block sum of the softmax over ``[start, len)``."""
    rng = random.Random(7500 + seed)
    c = draw_paged(rng)
    msg = describe(c)
    L = max(c["lens"])
    keys = R.gather_dense(c["k_pool"], c["block_table"], L).float()
    q = c["q"].view(c["B"], c["H"], c["G"], c["D"])
    qk = torch.einsum("bhgd,bhld->bhgl", q, keys)
    pos = torch.arange(L, device=DEVICE)
    ok = (pos >= c["start"].view(-1, 1)) & (pos < c["seq_lens"].view(-1, 1))  # [B, L]
    ts = R.token_scores(c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"])
    expect = qk.amax(2).masked_fill(~ok.unsqueeze(1), float("-inf"))
    assert torch.equal(ts.isneginf(), expect.isneginf()), msg
    torch.testing.assert_close(ts[ts.isfinite()], expect[expect.isfinite()], rtol=1e-5, atol=1e-5, msg=msg)

    ob = R.oracle_block_scores(c["q"], c["k_pool"], c["block_table"], c["seq_lens"], c["start"], c["scale"])
    assert ob.shape == (c["B"], c["H"], c["MB"]), msg
    for b in range(c["B"]):
        assert ob[b, :, c["nblk"][b] :].isneginf().all(), msg
        if not ok[b].any():  # nothing to attend: no mass anywhere (see test_oracle_scores_with_nothing_to_attend)
            assert not ob[b].isnan().any() and (ob[b, :, : c["nblk"][b]] <= 0).all(), msg
            continue
        mass = ob[b, :, : c["nblk"][b]]
        torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[:, 0], c["G"]), rtol=1e-5, atol=1e-5, msg=msg)
        p = (qk[b] * c["scale"]).masked_fill(~ok[b], float("-inf")).softmax(-1).sum(1)  # [H, L]
        per_block = torch.nn.functional.pad(p, (0, c["nblk"][b] * c["BS"] - L)) if c["nblk"][b] * c["BS"] > L else p
        per_block = per_block[:, : c["nblk"][b] * c["BS"]].reshape(c["H"], c["nblk"][b], c["BS"]).sum(-1)
        torch.testing.assert_close(mass, per_block, rtol=1e-5, atol=1e-6, msg=msg)


def draw_scores(rng: random.Random) -> tuple[torch.Tensor, int, torch.Tensor | None, bool]:
    lead = [rng.randint(1, 3), rng.randint(1, 3)]
    N = rng.choice((1, 2, rng.randint(3, 40), rng.randint(40, 300)))
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ties = rng.random() < 0.3
    s = torch.randint(-3, 4, (*lead, N), generator=g).float() if ties else torch.randn(*lead, N, generator=g)
    s[torch.rand(s.shape, generator=g) < rng.choice((0.0, 0.2, 0.6))] = float("-inf")
    if rng.random() < 0.3:  # past the sequence
        s[..., N - rng.randint(0, N) :] = float("-inf")
    if rng.random() < 0.4:  # forced entries (what the policies do for sink/window blocks)
        s[torch.rand(s.shape, generator=g) < 0.15] = float("inf")
    if rng.random() < 0.2:
        s[..., 0] = -0.0
    k = rng.choice((0, 1, rng.randint(1, N), N, N + rng.randint(1, 5)))
    counts = None
    if rng.random() < 0.5:
        counts = torch.tensor([rng.choice((0, rng.randint(0, k), k, k + 3)) for _ in range(lead[0])])
    return s.to(DEVICE), k, counts, ties


def check_topk_contract(idx: torch.Tensor, s: torch.Tensor, k: int, counts, msg: str) -> None:
    """Ascending distinct indices then ``-1``; as many as min(k, count, finite-or-+inf entries); never a ``-inf``;
    no unselected entry scores above a selected one."""
    assert idx.dtype == torch.int32 and idx.shape == (*s.shape[:-1], k), msg
    for r in range(s.shape[0]):
        for h in range(s.shape[1]):
            row, sc = idx[r, h].tolist(), s[r, h]
            n = sum(1 for x in row if x >= 0)
            assert all(x == -1 for x in row[n:]), f"-1 not at the end {row}: {msg}"
            sel = row[:n]
            assert sel == sorted(set(sel)), f"not ascending/distinct {row}: {msg}"
            avail = int((sc > float("-inf")).sum())
            want = min(k, avail, int(counts[r]) if counts is not None else k)
            assert n == want, f"row ({r},{h}) has {n} indices, want {want}: {msg}"
            if sel:
                chosen = sc[sel]
                assert (chosen > float("-inf")).all(), msg
                rest = torch.ones_like(sc, dtype=torch.bool)
                rest[sel] = False
                if rest.any():
                    assert chosen.min() >= sc[rest].max(), f"row ({r},{h}) skips a better entry: {msg}"


@pytest.mark.parametrize("seed", range(40))
def test_topk_indices_triton_matches_reference(seed):
    rng = random.Random(8000 + seed)
    s, k, counts, ties = draw_scores(rng)
    msg = f"shape={tuple(s.shape)}, k={k}, counts={counts}, ties={ties}"
    ref = R.topk_indices(s, k, counts)
    out = T_OPS.topk_indices(s, k, counts)
    check_topk_contract(ref, s, k, counts, "ref " + msg)
    check_topk_contract(out, s, k, counts, "triton " + msg)
    if not ties:  # the order of ties at the threshold is unspecified in torch.topk
        assert torch.equal(out, ref), msg


# ------------------------------------------------------------------------------------ edge cases found by the sweeps


def test_merge_partials_1d():
    """``o [S, D]``, ``lse [S]`` (no leading dims) is a valid ``[..., S, D]`` input: merge to ``[D]`` and ``[]``."""
    g = torch.Generator().manual_seed(0)
    o, lse = torch.randn(3, 16, generator=g).to(DEVICE), torch.randn(3, generator=g).to(DEVICE)
    ref, ref_tot = R.merge_partials(o, lse)
    assert ref.shape == (16,) and ref_tot.shape == ()
    out, tot = T_OPS.merge_partials(o, lse)
    assert out.shape == (16,) and tot.shape == ()
    assert rel_err(out, ref) < TOL
    check_lse(tot, ref_tot, "1d")


def test_oracle_scores_with_nothing_to_attend():
    """A sequence whose valid range is empty (``start == seq_len``) has no mass: 0 (or -inf) per block, never NaN,
    like decode's 0 output and -inf lse for an empty row."""
    g = torch.Generator().manual_seed(0)
    k_pool, q = torch.randn(2, 1, 8, 16, generator=g), torch.randn(1, 2, 16, generator=g)
    table, n = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    scores = R.oracle_block_scores(q, k_pool, table, n, n.clone(), 0.25)
    assert not scores.isnan().any(), scores


def test_reference_decode_blocks_takes_block_numbers_past_the_table():
    """decode_tokens (both backends) and the decode_blocks kernel accept indices past the block table (invalid by
    the validity rule, so ignored); the reference decode_blocks should too."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g).to(DEVICE) for s in ((1, 2, 16), (3, 1, 8, 16), (3, 1, 8, 16)))
    table, n = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE), torch.tensor([12], dtype=torch.int32)
    z = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    n = n.to(DEVICE)
    past = torch.tensor([[[0, 5]]], dtype=torch.int32, device=DEVICE)  # block 5 >= table width 2
    only = torch.tensor([[[0, -1]]], dtype=torch.int32, device=DEVICE)
    want = R.decode_blocks(q, k, v, table, n, z, only, z, z, 0.25)
    assert rel_err(T_OPS.decode_blocks(q, k, v, table, n, z, past, z, z, 0.25), want) < TOL
    assert rel_err(R.decode_blocks(q, k, v, table, n, z, past, z, z, 0.25), want) < TOL
