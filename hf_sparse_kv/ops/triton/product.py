"""Product-quantized keys for selection: the Triton twins of ``reference.pq_block_scores``, ``pq_encode`` and
``pq_write``.

A key's codes are ``M = D / d`` bytes, piece ``j``'s code the index of its nearest of the ``C`` centres
``centres[h, j]`` (``reference.pq_encode``). The score of query head ``g`` against a coded key is a sum of ``M``
table entries: ``scale * q_g . k_hat = sum_j T[g, j, code_j]`` with the table ``T[g, j, c] = scale * q_g[piece j] .
centres[h, j, c]``.

- :func:`pq_group_table`: the table, ``[B, Hkv, M, C, GP]`` float32 (or bfloat16: ``table_dtype``) with the GQA
  group's ``G`` query heads last (rounded up to a power of two ``GP``, zero past ``G``), one program per (sequence,
  KV head, piece): ``G x D x C`` multiply-adds a KV head, e.g. 64 KiB of table for 4 query heads, 16 pieces and 256
  centres (32 KiB in bfloat16); it stays in L2. The lse kernel sums the gathered entries in float32 either way.
- :func:`pq_group_table_lse`: one program per (tile of ``BM`` logical blocks, sequence, KV head) loads the tile's
  codes as one ``[BM, BS, M]`` uint8 tile through the block table (``M`` bytes a token, one contiguous run a block),
  gathers for each (token, piece) the group's ``GP`` entries of its code in one vector load, sums them over the
  pieces and stores each block's log-sum-exp per query head over its valid positions (``start <= p < seq_len``,
  block held; ``-inf`` where none is): ``reference``'s ``oracle_block_scores`` on the decoded keys, before its
  softmax. It reads the codes (``M`` bytes a key: 1/16 of a 16-bit key at ``d = 8``) and gathers from the table.
  :func:`pq_block_lse` is the two.
- :func:`pq_encode`: the codes themselves, each piece's nearest centre, one program per (tokens, KV head, piece)
  with the piece's centres and the tokens' distances in registers (a prefill fit's k-means rounds run it).
- :func:`pq_write`: the same nearest centres computed and stored in place, one program per (block the written
  positions touch, sequence, KV head, piece), as ``quant_write`` writes the low-bit codes.
- :func:`pq_block_scores`: :func:`pq_block_lse`, then the low-bit keys' tail (``quant.quant_lse_mass``: each
  head's softmax shares summed over the group, ``+inf`` at the forced blocks); shapes the kernel does not take
  (``M`` or ``BS`` not a power of two) run the reference.

Tested against the reference under the interpreter and built for sm_90 on the CPU (tests/compile_sm90.py). On the
H200 (2026-12-04, benchmarks/check_pq.py, Llama-3-8B layer; benchmarks/RESULTS.md), right against the float32
reference at every knob: the lse kernel at its default (4 blocks a program, 1 warp) 42.8 / 88.5 us at 1 x 128K /
8 x 32K, the table 4.8 / 8.0 us; the layout before (one scalar load a (token, piece, head), the table a torch
einsum of 18 / 22 us) took 47.3 / 91.3 us at its best. Its time grows with the warps at a fixed tile (e.g. 1 block
a program: 55 / 87 / 168 us at 1 / 2 / 4 warps); a layout looping over the pieces was slower at every knob.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from .quant import quant_lse_mass
from .written import written_block


@triton.jit
def block_tile(block_table, seq_lens, start, i_b, i_m, MB, BM: tl.constexpr, BS: tl.constexpr):
    """The ``i_m``-th tile of ``BM`` logical blocks of sequence ``i_b``: ``o_m [BM]`` the logical blocks, ``m_m [BM]``
    those inside the table, ``phys [BM]`` int64 their physical blocks (0 where none is held), ``ok [BM, BS]`` the
    positions to score (block held, ``start <= p < seq_len``)."""
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < MB
    phys = tl.load(block_table + i_b * MB + o_m, mask=m_m, other=-1)
    held = m_m & (phys >= 0)
    phys = tl.maximum(phys, 0).to(tl.int64)
    n = tl.load(seq_lens + i_b)
    s0 = tl.load(start + i_b)
    pos = o_m[:, None] * BS + tl.arange(0, BS)[None, :]
    ok = held[:, None] & (pos >= s0) & (pos < n)
    return o_m, m_m, phys, ok


@triton.jit
def tile_lse(s, ok):
    """``[BM, GP]``: per block of a tile and head, the log-sum-exp of the scores ``s [BM, BS, GP]`` over the block's
    valid positions ``ok [BM, BS]``, ``-inf`` where none is."""
    s = tl.where(ok[:, :, None], s, float("-inf"))
    top = tl.max(s, axis=1)  # [BM, GP]
    empty = top == float("-inf")  # no valid position
    safe = tl.where(empty, 0.0, top)
    total = tl.sum(tl.exp(s - safe[:, None, :]), axis=1)
    return tl.where(empty, float("-inf"), safe + tl.log(tl.where(empty, 1.0, total)))


@triton.jit
def pq_group_lse_kernel(
    table,  # [B, H, M, C, GP] float32 or bfloat16: scale * q_piece . centre, the group's heads last (zero past G)
    codes,  # [NB, H, BS, M] uint8
    block_table,  # [B, MB]
    seq_lens,  # [B]
    start,  # [B]
    out,  # [B, HQ, MB] float32
    s_cn,  # codes stride between blocks
    MB,
    HQ: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,  # G rounded up to a power of two
    M: tl.constexpr,
    C: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m, m_m, phys, ok = block_tile(block_table, seq_lens, start, i_b, i_m, MB, BM, BS)
    o_t = tl.arange(0, BS)
    o_j = tl.arange(0, M)
    o_g = tl.arange(0, GP)
    ok3 = ok[:, :, None] & (o_j[None, None, :] < M)
    row = phys[:, None, None] * s_cn + ((i_h * BS + o_t[None, :, None]) * M + o_j[None, None, :])  # [BM, BS, M]
    code = tl.load(codes + row, mask=ok3, other=0).to(tl.int32)
    entry = (o_j[None, None, :] * C + code) * GP  # [BM, BS, M]: a (piece, centre)'s GP entries, one vector load
    base = table + i_bh.to(tl.int64) * (M * C * GP)
    val = tl.load(base + entry[:, :, :, None] + o_g[None, None, None, :], mask=ok3[:, :, :, None], other=0.0)
    s = tl.sum(val.to(tl.float32), axis=2)  # [BM, BS, GP], summed in float32 whatever the table's dtype
    lse = tile_lse(s, ok)
    head = (i_b * HQ + i_h * G + o_g).to(tl.int64)  # [GP]
    tl.store(out + head[None, :] * MB + o_m[:, None], lse, mask=m_m[:, None] & (o_g[None, :] < G))


@triton.jit
def pq_group_table_kernel(
    q,  # [B, HQ, D]: last dim contiguous
    centres,  # [H, M, C, d] float32, contiguous
    table,  # [B, H, M, C, GP] float32 or bfloat16 (rounded on store)
    scale,
    s_qb,  # q's stride between sequences
    s_qh,  # q's stride between heads
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,  # C rounded up to a power of two
    d: tl.constexpr,
):
    i_bh, i_j = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_c = tl.arange(0, CP)
    m_c = o_c < C
    o_g = tl.arange(0, GP)
    m_g = o_g < G
    base_q = q + i_b.to(tl.int64) * s_qb + (i_h * G + o_g) * s_qh + i_j * d  # [GP]
    base_c = centres + ((i_h * M + i_j) * C + o_c) * d  # [CP]
    acc = tl.zeros([CP, GP], dtype=tl.float32)
    for k in tl.static_range(d):
        b_c = tl.load(base_c + k, mask=m_c, other=0.0)
        b_q = tl.load(base_q + k, mask=m_g, other=0.0).to(tl.float32)
        acc += b_c[:, None] * b_q[None, :]
    out = table + ((i_bh.to(tl.int64) * M + i_j) * C + o_c[:, None]) * GP + o_g[None, :]
    tl.store(out, (acc * scale).to(table.dtype.element_ty), mask=m_c[:, None])  # heads past G: zero (q masked to 0)


@triton.jit
def nearest_centre(base_x, m_x, base_c, o_c, m_c, d: tl.constexpr, R: tl.constexpr, CP: tl.constexpr):
    """``[R]`` int32: for ``R`` pieces of ``d`` channels (``base_x [R]`` pointers to their first channel, ``m_x``
    their mask), the index of the nearest of the piece's centres (``base_c``: ``[C, d]`` float32, rows ``o_c [CP]``
    valid where ``m_c``) by ``|c|^2 - 2 x . c`` in float32, ties to the lower index."""
    dot = tl.zeros([R, CP], dtype=tl.float32)
    norm = tl.zeros([CP], dtype=tl.float32)
    for k in tl.static_range(d):  # d multiply-adds a (piece, centre): no tensor-core tile is that thin
        b_c = tl.load(base_c + o_c * d + k, mask=m_c, other=0.0)
        b_x = tl.load(base_x + k, mask=m_x, other=0.0).to(tl.float32)
        dot += b_x[:, None] * b_c[None, :]
        norm += b_c * b_c
    dist = tl.where(m_c[None, :], norm[None, :] - 2 * dot, float("inf"))
    return tl.argmin(dist, axis=1, tie_break_left=True)


@triton.jit
def pq_encode_kernel(
    keys,  # [N, H, D]: last dim contiguous
    centres,  # [H, M, C, d] float32, contiguous
    out,  # [N, H, M] uint8, contiguous
    N,
    s_kn,  # keys' stride between tokens
    s_kh,  # keys' stride between heads
    H: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,  # C rounded up to a power of two
    d: tl.constexpr,
    BN: tl.constexpr,  # tokens a program
):
    i_n, i_hj = tl.program_id(0), tl.program_id(1)
    i_h, i_j = i_hj // M, i_hj % M
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_c = tl.arange(0, CP)
    m_c = o_c < C
    base_k = keys + o_n.to(tl.int64) * s_kn + i_h * s_kh + i_j * d
    code = nearest_centre(base_k, m_n, centres + i_hj * C * d, o_c, m_c, d, BN, CP)
    tl.store(out + o_n.to(tl.int64) * (H * M) + i_hj, code.to(tl.uint8), mask=m_n)


def pq_encode(keys: torch.Tensor, centres: torch.Tensor, block_n: int = 32, num_warps: int = 2) -> torch.Tensor:
    """Product-quantization codes of ``keys [..., Hkv, D]`` against ``centres [Hkv, m, C, d]``: ``[..., Hkv, m]``
    uint8, each piece's nearest centre by ``|c|^2 - 2 k . c`` in float32 (the contract of ``reference.pq_encode``;
    a near tie may go the other way: the sums run in another order). One program per (``block_n`` tokens, head,
    piece) holds the piece's ``C`` centres and the tokens' ``[block_n, C]`` distances in registers: nothing of that
    size is written (the reference writes ``[chunk, Hkv, m, C]`` float32 distances). Defaults from the H200
    (2026-12-04, 16384 keys x 8 heads x 16 pieces x 256 centres): 0.97 ms at 32 tokens and 2 warps, 1.05 at 64 / 2,
    1.72 at 64 / 4, 15.2 at 128 / 8; the reference's codes everywhere."""
    Hkv, m, C, d = reference.pq_encode_sizes(keys, centres)
    lead = keys.shape[:-2]
    x = keys.reshape(-1, Hkv, m * d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    N = x.shape[0]
    out = torch.empty(N, Hkv, m, dtype=torch.uint8, device=keys.device)
    if N:
        grid = (triton.cdiv(N, block_n), Hkv * m)
        pq_encode_kernel[grid](
            x, centres.float().contiguous(), out, N, x.stride(0), x.stride(1),
            H=Hkv, M=m, C=C, CP=triton.next_power_of_2(C), d=d, BN=block_n, num_warps=num_warps,
        )  # fmt: skip
    return out.reshape(*lead, Hkv, m)


@triton.jit
def pq_write_kernel(
    codes,  # [NB, H, BS, M] uint8
    k_pool,  # [NB, H, BS, D]
    centres,  # [H, M, C, d] float32, contiguous
    block_table,  # [B, MB]
    lo,  # [B]
    hi,  # [B]
    s_pn,  # key pool stride between blocks
    s_cn,  # codes stride between blocks
    MB,
    H: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,  # C rounded up to a power of two
    d: tl.constexpr,
    BS: tl.constexpr,
):
    i_n, i_bh, i_j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    b_lo, b_hi, lb, b_phys, ok = written_block(lo, hi, block_table, i_b, i_n, MB, BS)
    if not ok:
        return
    o_t = tl.arange(0, BS)
    pos = lb * BS + o_t
    m_t = (pos >= b_lo) & (pos < b_hi)
    o_c = tl.arange(0, CP)
    m_c = o_c < C
    base_k = k_pool + b_phys * s_pn + i_h * BS * D + o_t * D + i_j * d
    code = nearest_centre(base_k, m_t, centres + (i_h * M + i_j) * C * d, o_c, m_c, d, BS, CP)
    tl.store(codes + b_phys * s_cn + i_h * BS * M + o_t * M + i_j, code.to(tl.uint8), mask=m_t)


def pq_write(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
) -> None:
    """Store, in place, the codes (:func:`pq_encode`'s, nearest centre a piece) of the stored positions ``lo[b] <= p <
    hi[b]`` (the contract of ``reference.pq_write``): one program per (block the positions touch, sequence, KV head,
    piece) reads the piece of the block's keys and writes the codes of its positions in range, nothing else (no
    gather, no scatter). On the H200 (2026-12-04, one decode token, Llama-3-8B layer) a program per (block, sequence,
    head) looping over the 16 pieces took 68 / 65 us at 1 x 128K / 8 x 32K: 16 dependent rounds of loads from 16
    programs; one program a piece runs them side by side.

    Args:
        codes: ``[NB, Hkv, BS, m]`` uint8 (inner dims contiguous); k_pool: ``[NB, Hkv, BS, D]`` (inner dims
        contiguous); centres: ``[Hkv, m, C, d]``; block_table: ``[B, MB]``; lo, hi: ``[B]``; span: a host int
        ``>= max(hi - lo)``.
    """
    NB, H, BS, D = k_pool.shape
    Hc, M, C, d = centres.shape
    assert Hc == H and M * d == D and C <= 256, f"centres {tuple(centres.shape)} for keys {tuple(k_pool.shape)}"
    assert codes.shape == (NB, H, BS, M) and codes.dtype == torch.uint8, f"{codes.shape} {codes.dtype}"
    assert k_pool.stride()[1:] == (BS * D, D, 1) and codes.stride()[1:] == (BS * M, M, 1)
    assert triton.next_power_of_2(BS) == BS, "a power-of-two block"
    B = block_table.shape[0]
    assert lo.shape == (B,) and hi.shape == (B,)
    if span <= 0 or B == 0:
        return
    pq_write_kernel[(triton.cdiv(span, BS) + 1, B * H, M)](
        codes, k_pool, centres.float().contiguous(), block_table.contiguous(), lo.contiguous(), hi.contiguous(),
        k_pool.stride(0), codes.stride(0), block_table.shape[1],
        H=H, D=D, M=M, C=C, CP=triton.next_power_of_2(C), d=d, BS=BS, num_warps=4,
    )  # fmt: skip


def pq_block_lse(
    q: torch.Tensor,
    codes: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    tpp: int = 4,
    num_warps: int = 1,
    table_dtype: str = "float32",
) -> torch.Tensor:
    """``[B, Hq, MB]`` float32: per query head and logical block, the log-sum-exp of ``scale * q . k_hat`` over the
    block's valid positions, ``-inf`` where none is (``k_hat``: the keys the codes stand for): :func:`pq_group_table`
    (in ``table_dtype``), then :func:`pq_group_table_lse` (``tpp``: blocks a program, a power of two);
    ``reference.pq_block_lse``."""
    table = pq_group_table(q, centres, scale, table_dtype)  # checks q against the centres, as the kernel the codes
    return pq_group_table_lse(
        table, codes, block_table, seq_lens, start, q.shape[1] // centres.shape[0], tpp, num_warps
    )


def pq_group_table(q: torch.Tensor, centres: torch.Tensor, scale: float, table_dtype: str = "float32") -> torch.Tensor:
    """``[B, Hkv, M, C, GP]`` in ``table_dtype`` (``"float32"`` or ``"bfloat16"``: computed in float32, rounded on
    store): ``scale * q_g[piece j] . centres[h, j, c]`` at ``[b, h, j, c, g]`` for query head ``g < G`` of KV head
    ``h`` (``q [B, Hq, D]``, ``centres [Hkv, M, C, d]``), zero at the ``GP - G`` heads that round ``G`` up to a power
    of two: a (piece, centre)'s entries for the whole group lie side by side. One Triton program per (sequence, KV
    head, piece)."""
    B, HQ, D = q.shape
    H, M, C, d = centres.shape
    assert HQ % H == 0 and M * d == D, f"q {tuple(q.shape)} for centres {tuple(centres.shape)}"
    G = HQ // H
    GP = triton.next_power_of_2(G)
    out = torch.empty(B, H, M, C, GP, dtype=reference.pq_table_dtype(table_dtype), device=q.device)
    if B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    pq_group_table_kernel[(B * H, M)](
        q, centres.float().contiguous(), out, float(scale), q.stride(0), q.stride(1),
        H=H, G=G, GP=GP, M=M, C=C, CP=triton.next_power_of_2(C), d=d, num_warps=4,
    )  # fmt: skip
    return out


def pq_group_table_lse(
    table: torch.Tensor,
    codes: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    group: int,
    tpp: int = 4,
    num_warps: int = 1,
) -> torch.Tensor:
    """:func:`pq_block_lse` on a table :func:`pq_group_table` made (``table [B, Hkv, M, C, GP]`` float32 or
    bfloat16, ``group`` query heads a KV head): the kernel alone, ``[B, Hkv * group, MB]`` float32."""
    B, H, M, C, GP = table.shape
    BS = codes.shape[2]
    assert codes.dtype == torch.uint8 and codes.shape[1] == H and codes.shape[3] == M and table.is_contiguous()
    assert GP == triton.next_power_of_2(group), f"a table of {GP} heads for a group of {group}"
    assert codes.stride()[1:] == (BS * M, M, 1), "codes must be contiguous within a block"
    assert triton.next_power_of_2(M) == M and triton.next_power_of_2(BS) == BS and triton.next_power_of_2(tpp) == tpp
    MB = block_table.shape[1]
    out = torch.empty(B, H * group, MB, dtype=torch.float32, device=table.device)
    if B == 0 or MB == 0:
        return out
    grid = (triton.cdiv(MB, tpp), B * H)
    pq_group_lse_kernel[grid](
        table, codes, block_table.contiguous(), seq_lens.contiguous(), start.contiguous(), out, codes.stride(0), MB,
        HQ=H * group, H=H, G=group, GP=GP, M=M, C=C, BS=BS, BM=tpp, num_warps=num_warps,
    )  # fmt: skip
    return out


def pq_block_scores(
    q: torch.Tensor,
    codes: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int = 0,
    window: int | None = None,
    table_dtype: str = "float32",
) -> torch.Tensor:
    """Each block's softmax mass under the product-quantized keys, summed over each GQA group: ``[B, Hkv, MB]``
    float32 (the contract of ``reference.pq_block_scores``), in four launches (:func:`pq_block_lse`'s two, then
    ``quant_lse_mass``'s); ``table_dtype="bfloat16"`` holds the table in bfloat16. Pieces or blocks not a power of
    two run the reference."""
    H, BS, M = codes.shape[1], codes.shape[2], codes.shape[3]
    if triton.next_power_of_2(M) != M or triton.next_power_of_2(BS) != BS:
        return reference.pq_block_scores(
            q, codes, centres, block_table, seq_lens, start, scale, sink, window, table_dtype
        )
    lse = pq_block_lse(q, codes, centres, block_table, seq_lens, start, scale, table_dtype=table_dtype)
    return quant_lse_mass(lse, block_table, seq_lens, start, BS, H, sink, window)
