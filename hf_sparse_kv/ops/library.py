"""The decode ops as PyTorch custom ops (``torch.library``), so that a static decode step traces under
``torch.compile(fullgraph=True)``.

Each op of :data:`REGISTERED` is registered once, at import, as ``hf_sparse_kv::<name>`` (:data:`NAMESPACE`) with a
fake (meta) implementation that gives its output's shape: the registration is an entry in PyTorch's op registry, not
state of this package. The real implementation dispatches on its ``backend`` argument to :mod:`.reference` or to the
Triton launcher of the same name (whose host-side checks, split choice and launch dynamo therefore never sees).

Why ``torch.library.custom_op`` and not ``triton_op`` / ``wrap_triton``: a custom op is opaque to dynamo and to
inductor, which is what the launchers need (asserts on strides, a split count read from the device's properties,
the reference's per-sequence loops), and it traces the same way on torch 2.11 and 2.13; ``triton_op`` would let
inductor see the kernels but traces the launcher's Python, which would have to become trace-safe first. Inductor
still fuses everything around the ops (norms, rotary, MLP); the ops hold no host sync, so a CUDA graph captures
them.

The selectors' ops (``projected_write``, ``projected_scores``, ``candidate_scores`` in each form, ``candidate_mass``,
``block_shares``, ``quant_write``, ``quant_block_scores``, ``pq_encode``, ``pq_write``, ``pq_block_scores``: the
compressed-key, two-stage, top-p, low-bit-key and product-quantized-key policies) are registered the same way;
``projected_write``, ``quant_write`` and ``pq_write`` run inside a static step's write (the
:class:`~hf_sparse_kv.policies.StateSpec` refreshes) and mutate their state.

The ops whose reference is plain tensor code with static shapes (``blocks_to_tokens``, ``selection_to_mask``,
``gather_dense``, ``merge_partials``) are not registered: dynamo traces them as they are.
"""

from types import SimpleNamespace

import torch

from . import reference

# the package's own name: "hf_sparse_kv", or the name another copy of it was imported under (benchmarks/bench_ab.py
# imports an older version as "hf_sparse_kv_old" beside this one: one registry, two sets of ops)
NAMESPACE = __name__.split(".")[0]


def _impl(backend: str, name: str):
    """The backend's implementation of op ``name`` (Triton falls back to the reference for the ops it lacks)."""
    if backend == "triton":
        from . import triton as triton_ops  # optional package, imported on first use

        return getattr(triton_ops, name, None) or getattr(reference, name)
    return getattr(reference, name)


# ---- registrations (PyTorch's op registry, filled once at import) ----------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::paged_write", mutates_args=("k_pool", "v_pool", "kmin", "kmax", "kmean"))
def paged_write_op(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    pos0: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    backend: str,
) -> None:
    """``reference.paged_write``: ``[B, Hkv, T, D]`` new keys/values into pools ``[NB, Hkv, BS, D]``, in place."""
    _impl(backend, "paged_write")(k_pool, v_pool, kmin, kmax, kmean, block_table, pos0, k_new, v_new)


@paged_write_op.register_fake
def _(k_pool, v_pool, kmin, kmax, kmean, block_table, pos0, k_new, v_new, backend):
    return None


@torch.library.custom_op(f"{NAMESPACE}::block_scores", mutates_args=())
def block_scores_op(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    method: str,
    start: torch.Tensor | None,
    sink: int,
    window: int | None,
    backend: str,
) -> torch.Tensor:
    """``reference.block_scores``: ``[B, Hkv, MB]`` float32."""
    fn = _impl(backend, "block_scores")
    return fn(q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window)


@block_scores_op.register_fake
def _(q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window, backend):
    return q.new_empty(q.shape[0], kmin.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::block_shares", mutates_args=())
def block_shares_op(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    pool: str,
    start: torch.Tensor | None,
    sink: int,
    window: int | None,
    backend: str,
) -> torch.Tensor:
    """``reference.block_shares`` (no Triton kernel: both backends run the reference): ``[B, Hkv, MB]`` float32."""
    return reference.block_shares(q, kmin, kmax, block_table, seq_lens, block_size, scale, pool, start, sink, window)


@block_shares_op.register_fake
def _(q, kmin, kmax, block_table, seq_lens, block_size, scale, pool, start, sink, window, backend):
    return q.new_empty(q.shape[0], kmin.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::token_scores", mutates_args=())
def token_scores_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    length: int,
    backend: str,
) -> torch.Tensor:
    """``reference.token_scores`` over ``length`` positions: ``[B, Hkv, length]`` float32."""
    return _impl(backend, "token_scores")(q, k_pool, block_table, seq_lens, start, length)


@token_scores_op.register_fake
def _(q, k_pool, block_table, seq_lens, start, length, backend):
    return q.new_empty(q.shape[0], k_pool.shape[1], length, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::oracle_block_scores", mutates_args=())
def oracle_block_scores_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    length: int,
    backend: str,
) -> torch.Tensor:
    """``reference.oracle_block_scores`` over ``length`` positions: ``[B, Hkv, MB]`` float32."""
    return _impl(backend, "oracle_block_scores")(q, k_pool, block_table, seq_lens, start, scale, length)


@oracle_block_scores_op.register_fake
def _(q, k_pool, block_table, seq_lens, start, scale, length, backend):
    return q.new_empty(q.shape[0], k_pool.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::topk_indices", mutates_args=())
def topk_indices_op(scores: torch.Tensor, k: int, counts: torch.Tensor | None, backend: str) -> torch.Tensor:
    """``reference.topk_indices``: ``[..., N]`` -> ``[..., k]`` int32. Per-sequence ``counts`` are read on the
    device by either backend (no host sync)."""
    return _impl(backend, "topk_indices")(scores, k, counts)


@topk_indices_op.register_fake
def _(scores, k, counts, backend):
    return scores.new_empty(*scores.shape[:-1], k, dtype=torch.int32)


def _decode_schema(name: str):
    @torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())
    def op(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        start: torch.Tensor,
        sel: torch.Tensor,
        ex_lo: torch.Tensor,
        ex_hi: torch.Tensor,
        scale: float,
        backend: str,
    ) -> torch.Tensor:
        return _impl(backend, name)(q, k_pool, v_pool, block_table, seq_lens, start, sel, ex_lo, ex_hi, scale)

    @op.register_fake
    def _(q, k_pool, v_pool, block_table, seq_lens, start, sel, ex_lo, ex_hi, scale, backend):
        return torch.empty_like(q)

    return op


decode_blocks_op = _decode_schema("decode_blocks")  # [B, Hq, D] over selected blocks
decode_tokens_op = _decode_schema("decode_tokens")  # [B, Hq, D] over selected token positions


@torch.library.custom_op(f"{NAMESPACE}::decode_masked", mutates_args=())
def decode_masked_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """``reference.decode_masked``: ``[B, Hq, D]``."""
    return _impl(backend, "decode_masked")(q, k_pool, v_pool, block_table, seq_lens, mask, scale)


@decode_masked_op.register_fake
def _(q, k_pool, v_pool, block_table, seq_lens, mask, scale, backend):
    return torch.empty_like(q)


# ---- the selectors' ops (policies/projected.py, two_stage.py, top_p.py) ------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::projected_write", mutates_args=("ckeys",))
def projected_write_op(
    ckeys: torch.Tensor,
    k_pool: torch.Tensor,
    proj: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    backend: str,
) -> None:
    """``reference.projected_write``: the compressed keys ``ckeys [NB, Hkv, BS, R]`` of the stored positions
    ``lo[b] <= p < hi[b]`` from ``k_pool [NB, Hkv, BS, D]`` and ``proj [Hkv, D, R]``, in place (``span``: a host
    int ``>= max(hi - lo)``)."""
    _impl(backend, "projected_write")(ckeys, k_pool, proj, block_table, lo, hi, span)


@projected_write_op.register_fake
def _(ckeys, k_pool, proj, block_table, lo, hi, span, backend):
    return None


@torch.library.custom_op(f"{NAMESPACE}::projected_scores", mutates_args=())
def projected_scores_op(
    qp: torch.Tensor,
    ckeys: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    reduce: str,
    sink: int,
    window: int | None,
    qproj: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``reference.projected_scores``: ``qp [B, Hq, R]`` (or, with ``qproj [Hkv, D, R]``, the queries ``[B, Hq, D]``)
    against ``ckeys [NB, Hkv, BS, R]`` -> ``[B, Hkv, MB * BS]`` (``reduce="token"``) or ``[B, Hkv, MB]``
    (``"block"``) float32."""
    fn = _impl(backend, "projected_scores")
    return fn(qp, ckeys, block_table, seq_lens, start, reduce, sink, window, qproj=qproj)


@projected_scores_op.register_fake
def _(qp, ckeys, block_table, seq_lens, start, reduce, sink, window, qproj, backend):
    if reduce not in ("token", "block"):
        raise ValueError(f"reduce must be 'token' or 'block', got {reduce!r}")
    MB = block_table.shape[1]
    width = MB * ckeys.shape[2] if reduce == "token" else MB
    return qp.new_empty(qp.shape[0], ckeys.shape[1], width, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::candidate_scores", mutates_args=())
def candidate_scores_op(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    blocks: torch.Tensor,
    reduce: str,
    sink: int,
    window: int | None,
    scale: float | None,
    backend: str,
) -> torch.Tensor:
    """``reference.candidate_scores``: exact ``q . k`` of the tokens of the candidate ``blocks [B, Hkv, C]`` ->
    ``[B, Hkv, C, BS]`` (``reduce="token"``), or per candidate ``[B, Hkv, C]``: its best token (``"block"``) or the
    log-sum-exp of its tokens' ``scale``-d scores (``"mass"``), or that log-sum-exp per query head ``[B, Hq, C]``
    (``"head_mass"``), float32."""
    fn = _impl(backend, "candidate_scores")
    return fn(q, k_pool, block_table, seq_lens, start, blocks, reduce=reduce, sink=sink, window=window, scale=scale)


@candidate_scores_op.register_fake
def _(q, k_pool, block_table, seq_lens, start, blocks, reduce, sink, window, scale, backend):
    reference.check_candidate_reduce(reduce, window, scale)
    if reduce == "head_mass":  # per query head
        return q.new_empty(q.shape[0], q.shape[1], blocks.shape[-1], dtype=torch.float32)
    per_token = (k_pool.shape[2],) if reduce == "token" else ()
    return q.new_empty(*blocks.shape, *per_token, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::candidate_mass", mutates_args=())
def candidate_mass_op(
    lse: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    block_size: int,
    sink: int,
    window: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.candidate_mass``: the log-sum-exps ``lse [B, Hq or Hkv, C]`` of the candidate ``blocks
    [B, Hkv, C]`` -> ``(mass, key)``, each ``[B, Hkv, C]`` float32 (each candidate's share of the candidates'
    softmax mass averaged over the group; ``+inf`` at forced candidates, ``-inf`` at padding, the mass elsewhere)."""
    mass, key = _impl(backend, "candidate_mass")(lse, blocks, seq_lens, start, block_size, sink, window)
    return mass, key


@candidate_mass_op.register_fake
def _(lse, blocks, seq_lens, start, block_size, sink, window, backend):
    reference.check_candidate_mass(lse, blocks)
    return (lse.new_empty(blocks.shape, dtype=torch.float32), lse.new_empty(blocks.shape, dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::quant_write", mutates_args=("codes",))
def quant_write_op(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    bits: int,
    backend: str,
) -> None:
    """``reference.quant_write``: re-code ``codes [NB, Hkv, BS, D * bits // 8]`` of the blocks holding the stored
    positions ``lo[b] <= p < hi[b]`` from ``k_pool [NB, Hkv, BS, D]``, in place."""
    _impl(backend, "quant_write")(codes, k_pool, block_table, lo, hi, span, bits)


@quant_write_op.register_fake
def _(codes, k_pool, block_table, lo, hi, span, bits, backend):
    return None


@torch.library.custom_op(f"{NAMESPACE}::quant_block_scores", mutates_args=())
def quant_block_scores_op(
    q: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    bits: int,
    sink: int,
    window: int | None,
    backend: str,
) -> torch.Tensor:
    """``reference.quant_block_scores``: each block's mass under the ``bits``-bit keys, ``[B, Hkv, MB]`` float32
    (``+inf`` at the forced blocks still held when ``window`` is given)."""
    fn = _impl(backend, "quant_block_scores")
    return fn(q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, sink, window)


@quant_block_scores_op.register_fake
def _(q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, sink, window, backend):
    return q.new_empty(q.shape[0], codes.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::fp8_write", mutates_args=("state",))
def fp8_write_op(
    state: torch.Tensor,
    k_pool: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    part: str,
    backend: str,
) -> None:
    """``reference.fp8_write``: one part (``"codes"`` / ``"scales"``) of the float8 code of the keys at the stored
    positions ``lo[b] <= p < hi[b]``, in place."""
    _impl(backend, "fp8_write")(state, k_pool, block_table, lo, hi, span, part)


@fp8_write_op.register_fake
def _(state, k_pool, block_table, lo, hi, span, part, backend):
    return None


@torch.library.custom_op(f"{NAMESPACE}::fp8_block_scores", mutates_args=())
def fp8_block_scores_op(
    q: torch.Tensor,
    codes: torch.Tensor,
    kscale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int,
    window: int | None,
    backend: str,
) -> torch.Tensor:
    """``reference.fp8_block_scores``: each block's mass under the float8 keys, ``[B, Hkv, MB]`` float32 (``+inf``
    at the forced blocks still held when ``window`` is given)."""
    fn = _impl(backend, "fp8_block_scores")
    return fn(q, codes, kscale, block_table, seq_lens, start, scale, sink, window)


@fp8_block_scores_op.register_fake
def _(q, codes, kscale, block_table, seq_lens, start, scale, sink, window, backend):
    return q.new_empty(q.shape[0], codes.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::pq_encode", mutates_args=())
def pq_encode_op(keys: torch.Tensor, centres: torch.Tensor, backend: str) -> torch.Tensor:
    """``reference.pq_encode``: the codes ``[..., Hkv, m]`` uint8 of ``keys [..., Hkv, D]``, each piece's nearest of
    ``centres [Hkv, m, C, d]``."""
    return _impl(backend, "pq_encode")(keys, centres)


@pq_encode_op.register_fake
def _(keys, centres, backend):
    return keys.new_empty(*keys.shape[:-1], centres.shape[1], dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::pq_write", mutates_args=("codes",))
def pq_write_op(
    codes: torch.Tensor,
    k_pool: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    span: int,
    backend: str,
) -> None:
    """``reference.pq_write``: the product-quantization codes ``codes [NB, Hkv, BS, m]`` of the stored positions
    ``lo[b] <= p < hi[b]`` from ``k_pool [NB, Hkv, BS, D]`` and ``centres [Hkv, m, C, d]``, in place."""
    _impl(backend, "pq_write")(codes, k_pool, centres, block_table, lo, hi, span)


@pq_write_op.register_fake
def _(codes, k_pool, centres, block_table, lo, hi, span, backend):
    return None


@torch.library.custom_op(f"{NAMESPACE}::pq_block_scores", mutates_args=())
def pq_block_scores_op(
    q: torch.Tensor,
    codes: torch.Tensor,
    centres: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    sink: int,
    window: int | None,
    table_dtype: str,
    backend: str,
) -> torch.Tensor:
    """``reference.pq_block_scores``: each block's mass under the product-quantized keys, ``[B, Hkv, MB]`` float32
    (``+inf`` at the forced blocks still held when ``window`` is given; ``table_dtype``: its scoring table's)."""
    fn = _impl(backend, "pq_block_scores")
    return fn(q, codes, centres, block_table, seq_lens, start, scale, sink, window, table_dtype)


@pq_block_scores_op.register_fake
def _(q, codes, centres, block_table, seq_lens, start, scale, sink, window, table_dtype, backend):
    return q.new_empty(q.shape[0], codes.shape[1], block_table.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    """``reference.decode_linear``: a decode step's weight matmul, ``x [..., K]`` (at most 16 rows for Triton) times
    ``weight [N, K]``, -> ``[..., N]`` (:mod:`hf_sparse_kv.merge` calls it with ``kernel=True``)."""
    return _impl(backend, "decode_linear")(x, weight, bias)


@decode_linear_op.register_fake
def _(x, weight, bias, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


REGISTERED = (
    "paged_write",
    "block_scores",
    "block_shares",
    "token_scores",
    "oracle_block_scores",
    "topk_indices",
    "decode_blocks",
    "decode_tokens",
    "decode_masked",
    "projected_write",
    "projected_scores",
    "candidate_scores",
    "candidate_mass",
    "quant_write",
    "quant_block_scores",
    "pq_encode",
    "pq_write",
    "pq_block_scores",
    "decode_linear",
)


# ---- the namespace a static step calls ---------------------------------------------------------------------------


def registered_ops(backend: str) -> SimpleNamespace:
    """The op namespace of a resolved ``backend`` (``"reference"`` or ``"triton"``) whose ops go through the
    registered custom ops: the signatures of :mod:`.reference` (``token_scores`` and ``oracle_block_scores`` take
    their ``length`` as an int, required here: a static step never reads it off the device; the Triton launchers'
    tuning knobs are not arguments here, a static step runs their defaults)."""

    def paged_write(k_pool, v_pool, kmin, kmax, kmean, block_table, pos0, k_new, v_new):
        paged_write_op(k_pool, v_pool, kmin, kmax, kmean, block_table, pos0, k_new, v_new, backend)

    def block_scores(q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start=None, sink=0, window=None):
        return block_scores_op(
            q, kmin, kmax, kmean, block_table, seq_lens, block_size, method, start, sink, window, backend
        )

    def block_shares(
        q, kmin, kmax, block_table, seq_lens, block_size, scale, pool="mean", start=None, sink=0, window=None
    ):
        return block_shares_op(
            q, kmin, kmax, block_table, seq_lens, block_size, scale, pool, start, sink, window, backend
        )

    def token_scores(q, k_pool, block_table, seq_lens, start, length):
        return token_scores_op(q, k_pool, block_table, seq_lens, start, length, backend)

    def oracle_block_scores(q, k_pool, block_table, seq_lens, start, scale, length):
        return oracle_block_scores_op(q, k_pool, block_table, seq_lens, start, scale, length, backend)

    def topk_indices(scores, k, counts=None):
        return topk_indices_op(scores, k, counts, backend)

    def decode_blocks(q, k_pool, v_pool, block_table, seq_lens, start, blocks, ex_lo, ex_hi, scale):
        return decode_blocks_op(q, k_pool, v_pool, block_table, seq_lens, start, blocks, ex_lo, ex_hi, scale, backend)

    def decode_tokens(q, k_pool, v_pool, block_table, seq_lens, start, tokens, ex_lo, ex_hi, scale):
        return decode_tokens_op(q, k_pool, v_pool, block_table, seq_lens, start, tokens, ex_lo, ex_hi, scale, backend)

    def decode_masked(q, k_pool, v_pool, block_table, seq_lens, mask, scale):
        return decode_masked_op(q, k_pool, v_pool, block_table, seq_lens, mask, scale, backend)

    def projected_write(ckeys, k_pool, proj, block_table, lo, hi, span):
        projected_write_op(ckeys, k_pool, proj, block_table, lo, hi, span, backend)

    def projected_scores(qp, ckeys, block_table, seq_lens, start, reduce, sink=0, window=None, *, qproj=None):
        return projected_scores_op(qp, ckeys, block_table, seq_lens, start, reduce, sink, window, qproj, backend)

    def candidate_scores(
        q, k_pool, block_table, seq_lens, start, blocks, *, reduce="token", sink=0, window=None, scale=None
    ):
        return candidate_scores_op(
            q, k_pool, block_table, seq_lens, start, blocks, reduce, sink, window, scale, backend
        )

    def candidate_mass(lse, blocks, seq_lens, start, block_size, sink, window):
        return candidate_mass_op(lse, blocks, seq_lens, start, block_size, sink, window, backend)

    def quant_write(codes, k_pool, block_table, lo, hi, span, bits):
        quant_write_op(codes, k_pool, block_table, lo, hi, span, bits, backend)

    def quant_block_scores(q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, sink=0, window=None):
        return quant_block_scores_op(
            q, codes, kmin, kmax, block_table, seq_lens, start, scale, bits, sink, window, backend
        )

    def fp8_write(state, k_pool, block_table, lo, hi, span, part):
        fp8_write_op(state, k_pool, block_table, lo, hi, span, part, backend)

    def fp8_block_scores(q, codes, kscale, block_table, seq_lens, start, scale, sink=0, window=None):
        return fp8_block_scores_op(q, codes, kscale, block_table, seq_lens, start, scale, sink, window, backend)

    def pq_encode(keys, centres):
        return pq_encode_op(keys, centres, backend)

    def pq_write(codes, k_pool, centres, block_table, lo, hi, span):
        pq_write_op(codes, k_pool, centres, block_table, lo, hi, span, backend)

    def pq_block_scores(
        q, codes, centres, block_table, seq_lens, start, scale, sink=0, window=None, table_dtype="float32"
    ):
        return pq_block_scores_op(
            q, codes, centres, block_table, seq_lens, start, scale, sink, window, table_dtype, backend
        )

    return SimpleNamespace(
        name=backend,
        paged_write=paged_write,
        block_scores=block_scores,
        block_shares=block_shares,
        token_scores=token_scores,
        oracle_block_scores=oracle_block_scores,
        topk_indices=topk_indices,
        decode_blocks=decode_blocks,
        decode_tokens=decode_tokens,
        decode_masked=decode_masked,
        blocks_to_tokens=reference.blocks_to_tokens,
        selection_to_mask=reference.selection_to_mask,
        gather_dense=reference.gather_dense,
        merge_partials=reference.merge_partials,
        projected_write=projected_write,
        projected_scores=projected_scores,
        candidate_scores=candidate_scores,
        candidate_mass=candidate_mass,
        quant_write=quant_write,
        quant_block_scores=quant_block_scores,
        fp8_write=fp8_write,
        fp8_block_scores=fp8_block_scores,
        pq_encode=pq_encode,
        pq_write=pq_write,
        pq_block_scores=pq_block_scores,
    )
