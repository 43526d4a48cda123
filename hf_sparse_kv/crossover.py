"""The crossover table behind ``mode="auto"``: from which context length sparse decode beats dense.

A table holds measured entries ``{budget, batch, num_kv_heads, head_dim, crossover}``: at a context below
``crossover`` tokens a decode step runs dense (the block kernel over every block), at or above it runs the policy
(``crossover`` may be ``None``: sparse never won up to the longest context measured). ``hf-sparse-kv calibrate``
measures one on the current GPU (:mod:`hf_sparse_kv.calibrate`); a table measured on an H200 ships with the package.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

DEFAULT_TABLES = {"eager": "crossover_h200.json", "graph": "crossover_h200_graph.json"}


@dataclass
class CrossoverTable:
    """Measured crossovers. ``entries`` are dicts with keys ``budget`` (a fraction), ``batch``, ``num_kv_heads``,
    ``head_dim``, ``crossover`` (tokens, or ``None``); ``max_context`` is the longest context measured;
    ``fallback`` the crossover used for a head shape the table does not hold; ``timing`` how the steps were timed
    (``"eager"``, or ``"graph"`` for CUDA-graph decoding)."""

    entries: list[dict]
    device: str = "unknown"
    max_context: int = 0
    fallback: int | None = None
    source: str = ""
    timing: str = "eager"
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys = {"budget", "batch", "num_kv_heads", "head_dim", "crossover"}
        for e in self.entries:
            if not keys <= set(e):
                raise ValueError(f"crossover table entry {e} lacks {sorted(keys - set(e))}")
            if not 0 < float(e["budget"]) <= 1:
                raise ValueError(f"crossover table budgets are fractions in (0, 1], got {e['budget']}")

    def crossover(self, budget: float, batch: int, num_kv_heads: int, head_dim: int) -> int | None:
        """The context (tokens) from which sparse wins for this shape; ``None``: never (up to ``max_context``).

        Matching: the same head shape; the largest measured batch not above ``batch`` (else the smallest); the
        measured budget nearest in log scale. A head shape with no entry gets ``fallback``.
        """
        key = (round(budget, 6), batch, num_kv_heads, head_dim)
        if key not in self._memo:
            self._memo[key] = self._lookup(budget, batch, num_kv_heads, head_dim)
        return self._memo[key]

    def _lookup(self, budget: float, batch: int, num_kv_heads: int, head_dim: int) -> int | None:
        same = [e for e in self.entries if e["num_kv_heads"] == num_kv_heads and e["head_dim"] == head_dim]
        if not same:
            return self.fallback
        batches = sorted({e["batch"] for e in same})
        below = [b for b in batches if b <= batch]
        b = below[-1] if below else batches[0]
        rows = [e for e in same if e["batch"] == b]
        best = min(rows, key=lambda e: abs(math.log(float(e["budget"])) - math.log(budget)))
        return best["crossover"]

    def use_sparse(self, budget: float, batch: int, num_kv_heads: int, head_dim: int, context: int) -> bool:
        """Whether a decode step at ``context`` tokens should run sparse."""
        cross = self.crossover(budget, batch, num_kv_heads, head_dim)
        return cross is not None and context >= cross

    # ---- files ------------------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "max_context": self.max_context,
            "fallback": self.fallback,
            "source": self.source,
            "timing": self.timing,
            "entries": self.entries,
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def from_json(cls, data: dict) -> CrossoverTable:
        return cls(
            entries=list(data["entries"]),
            device=data.get("device", "unknown"),
            max_context=int(data.get("max_context", 0)),
            fallback=data.get("fallback"),
            source=data.get("source", ""),
            timing=data.get("timing", "eager"),
        )

    @classmethod
    def load(cls, path: str | Path | None = None, timing: str = "eager") -> CrossoverTable:
        """A table from ``path``, or when ``None`` the one shipped with the package for ``timing`` (``"eager"``
        or ``"graph"``; both measured on an H200)."""
        if path is None:
            text = resources.files("hf_sparse_kv.data").joinpath(DEFAULT_TABLES[timing]).read_text()
        else:
            text = Path(path).read_text()
        return cls.from_json(json.loads(text))


def budget_fraction(policy, context: int) -> float | None:
    """The fraction of ``context`` a policy's budget keeps (``None`` for a policy without a budget, e.g. Dense): what
    its :meth:`~hf_sparse_kv.policies.Policy.budget_fraction` says."""
    return policy.budget_fraction(context)
