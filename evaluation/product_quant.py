"""Issue 13, an experiment for the suite: two stages whose coarse pass reads product-quantized keys.

:mod:`evaluation.selector_probe` screened key approximations by hit rate against the oracle on captured queries and
keys. Product quantization (each key's channels cut into ``D / sub_dim`` pieces, each stored as the index of the
nearest of ``centroids`` k-means centres, as PQCache does for retrieval) kept more of the oracle's blocks at 1/16 of
K's bytes than 2-bit codes at 7/64; as the coarse pass of two stages (``candidates x`` the budget's blocks, then the
fine pass ranks them) it came within ~0.01 of 4-bit keys' hit rate. :class:`ProductQuantBlockTopK` is that selector as
a policy the suite can run (``name: "evaluation.product_quant:ProductQuantBlockTopK"``), to measure its perplexity
and retrieval where the probe cannot.

Reference ops only, no cache state: at each step the centres are fitted on the keys the pool holds (every valid
position of every held block, at most ``sample`` of them drawn at random, seeded: a k-means over all of a 32K batch's
keys at every layer of every step would take the suite longer than the model; a cache would fit them once on the
prompt and code each key as it is written), every key is coded with them, the
coarse mass is the GQA group's softmax mass under the coded keys, and the fine pass is ``fine``:

- ``"exact"``: the candidates' own keys (their true mass): no scoring state but the codes (``log2(centroids) / (16 x
  sub_dim)`` of K's bytes, 1/16 at 256 centres of 8 channels); the fine pass reads ``c x budget`` of K, of which the
  budget's keys are read again by the attention;
- ``"quant4"``: 4-bit codes on each block's min / max (``QuantBlockTopK(bits=4)``'s keys), 3/8 of K's bytes a
  candidate key (and that much more state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_sparse_kv.ops.reference import held_positions, oracle_block_scores
from hf_sparse_kv.policies.base import DecodeState

from .compact_grid import CompactGridBlockTopK, ProgressiveGridBlockTopK
from .selector_probe import ProductQuantized

FINE = ("exact", "quant4")


@dataclass
class ProductQuantBlockTopK(ProgressiveGridBlockTopK):
    """Blocks ranked by their mass under product-quantized keys keep ``candidates x`` the budget's (forced first);
    the ``fine`` pass picks the budget among them (module docstring). Args as
    :class:`~hf_sparse_kv.policies.Quest`, plus ``sub_dim`` (channels a piece; divides the head dim), ``centroids``
    (centres a piece, 2 to 65536), ``iters`` (k-means rounds), ``sample`` (keys the centres are fitted on, at most;
    ``None``: all), ``candidates`` (``c >= 1``) and ``fine``."""

    sub_dim: int = 8
    centroids: int = 256
    iters: int = 8
    sample: int | None = 16384
    candidates: float = 2
    fine: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, lo, hi in (("sub_dim", 1, 1 << 16), ("centroids", 2, 1 << 16), ("iters", 1, 1000)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer from {lo} to {hi}, not {v!r}")
        if self.sample is not None and (
            isinstance(self.sample, bool) or not isinstance(self.sample, int) or self.sample < 1
        ):
            raise ValueError(f"sample must be a positive integer or None, not {self.sample!r}")
        if self.fine not in FINE:
            raise ValueError(f"fine must be one of {FINE}, not {self.fine!r}")

    def coded_pool(self, state: DecodeState) -> torch.Tensor:
        """``[NB, Hkv, BS, D]`` in the pool's dtype: every key replaced by its product-quantized reconstruction,
        the centres fitted per KV head and piece on the valid keys of the held blocks."""
        pool = state.k_pool
        NB, H, BS, D = pool.shape
        if D % self.sub_dim:
            raise ValueError(f"sub_dim {self.sub_dim} does not divide the head dim {D}")
        flat = pool.float().transpose(1, 2).reshape(NB * BS, H, D)
        phys = state.block_table.long()
        held = phys >= 0
        w = held_positions(state.block_table, state.seq_lens, state.start, BS)  # [B, MB, BS]
        valid = torch.zeros(NB, BS, dtype=torch.int32, device=pool.device)
        valid.index_add_(0, phys[held], w[held].int())
        valid = valid.view(-1) > 0
        pq = ProductQuantized(self.sub_dim, self.centroids, self.iters, sample=self.sample)
        coded = pq.apply(flat, pq.fit(flat[valid]))
        return coded.view(NB, BS, H, D).transpose(1, 2).to(pool.dtype)

    def stage_masses(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coarse, fine)``, each ``[B, Hkv, nblk]``: every block's mass under the coded keys and under the fine
        pass's keys; ``-inf`` for blocks not in use."""
        args = (state.block_table, state.seq_lens, state.start, state.scale, state.length)
        coarse = oracle_block_scores(state.q, self.coded_pool(state), *args)
        if self.fine == "exact":
            return coarse, oracle_block_scores(state.q, state.k_pool, *args)
        quant4 = CompactGridBlockTopK(budget=self.budget, bits=4, group=state.block_size, meta="bf16")
        return coarse, quant4.mass(state)
