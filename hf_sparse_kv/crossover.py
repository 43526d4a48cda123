"""The crossover table behind ``mode="auto"``: from which context length sparse decode beats dense.

A table holds measured entries ``{budget, batch, num_kv_heads, head_dim, crossover}``: at a context below
``crossover`` tokens a decode step runs dense (the block kernel over every block), at or above it runs the policy
(``crossover`` may be ``None``: sparse never won up to the longest context measured). ``hf-sparse-kv calibrate``
measures one on the current GPU (:mod:`hf_sparse_kv.calibrate`) for any policy; tables ship with the package: for
eager steps one measured on an H200 with ``Quest``, for captured steps (``cuda_graph=True``) ones measured on an H100
with ``Quest``, the product-quantized two stages and ``QuantBlockTopK(bits=4)`` for the head shapes of Llama-3-8B,
Qwen2.5-1.5B, SmolLM2-135M and Gemma-3-270M's global layers (a head shape not in a table runs dense: measure yours).

A table says what it was measured with: the policy (:func:`policy_key`: its class and the settings that change a
selection's cost), the block size, the timing (eager or captured steps) and the GPU. A crossover holds only for what it was
measured with (a selector that costs three times Quest's selection crosses over at a longer context, or never), so
:meth:`CrossoverTable.mismatch` names every difference and ``patch_model(mode="auto")`` warns with them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

DEFAULT_TABLES = {"eager": "crossover_h200.json", "graph": "crossover_h100_graph.json"}
# a policy's settings that change what it forces or where its calibration comes from, not what a selection costs
COST_FREE_FIELDS = frozenset({"budget", "sink", "window", "calibration"})
# what `hf-sparse-kv calibrate` measured before tables recorded their policy: Quest (the only policy it timed)
LEGACY_POLICY = {"name": "Quest"}


def policy_key(policy) -> dict:
    """What of ``policy`` a crossover depends on, as JSON: ``{"name": class name, setting: value, ...}`` over its
    dataclass fields but :data:`COST_FREE_FIELDS` (a nested policy, e.g. SnapKV's ``then``, as its own key; a value
    that is not plain JSON as its ``repr``). Two policies with equal keys select at the same cost."""
    key = {"name": type(policy).__name__}
    if not dataclasses.is_dataclass(policy):
        return key
    for f in dataclasses.fields(policy):
        if not f.init or f.name.startswith("_") or f.name in COST_FREE_FIELDS:
            continue
        value = getattr(policy, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = policy_key(value)
        elif isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        key[f.name] = value
    return key


def calibrate_command(policy, block_size: int, timing: str, shape: tuple[int, int, int] | None = None) -> str:
    """The ``hf-sparse-kv calibrate`` command that measures a table for ``policy`` (its :func:`policy_key`'s settings
    as ``--policy-args``, and a calibration named by a string: a file or ``"prefill"``), ``block_size`` and
    ``timing``; with ``shape`` (query heads, KV heads, head dim) for that head shape (``--shapes``)."""
    args = {k: v for k, v in policy_key(policy).items() if k != "name"}
    calibration = getattr(policy, "calibration", None)
    if isinstance(calibration, str):
        args["calibration"] = calibration
    parts = ["hf-sparse-kv calibrate", f"--policy {type(policy).__name__}"]
    if args:
        parts.append(f"--policy-args '{json.dumps(args)}'")
    parts.append(f"--block-size {block_size}")
    if timing == "graph":
        parts.append("--timing graph")
    if shape is not None:
        parts.append(f"--shapes {','.join(map(str, shape))}")
    return " ".join([*parts, "--out mine.json"])


def describe_key(key: dict) -> str:
    """``Name(setting=value, ...)`` of a :func:`policy_key`."""
    args = ", ".join(f"{k}={v!r}" for k, v in key.items() if k != "name")
    return f"{key.get('name', '?')}({args})"


@dataclass
class CrossoverTable:
    """Measured crossovers. ``entries`` are dicts with keys ``budget`` (a fraction), ``batch``, ``num_kv_heads``,
    ``head_dim``, ``crossover`` (tokens, or ``None``); ``max_context`` is the longest context measured;
    ``fallback`` the crossover used for a head shape the table does not hold; ``timing`` how the steps were timed
    (``"eager"``, or ``"graph"`` for CUDA-graph decoding); ``policy`` the :func:`policy_key` of the policy measured
    and ``block_size`` its pages (``None``: not recorded, e.g. a table written by hand; then not checked)."""

    entries: list[dict]
    device: str = "unknown"
    max_context: int = 0
    fallback: int | None = None
    source: str = ""
    timing: str = "eager"
    policy: dict | None = None
    block_size: int | None = None
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

    def holds(self, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the table decides for this head shape: it has entries for it, or a ``fallback`` (else
        :meth:`crossover` is ``None`` at every batch and budget: ``mode="auto"`` never runs sparse)."""
        return self.fallback is not None or any(
            e["num_kv_heads"] == num_kv_heads and e["head_dim"] == head_dim for e in self.entries
        )

    def mismatch(self, policy, block_size: int, timing: str, device: str | None = None) -> list[str]:
        """What differs between how this table was measured and how it would be used (empty: nothing recorded
        differs): ``policy``'s :func:`policy_key`, ``block_size``, ``timing`` (``"graph"`` for captured steps) and,
        when given, ``device``, the name of the GPU it would decide for (``torch.cuda.get_device_name``: another card
        moves the crossovers with its bandwidth, its SMs and, for ``Fp8BlockTopK`` below compute capability 8.9, the
        kernels' form)."""
        problems = []
        if device is not None and self.device not in ("unknown", device):
            problems.append(f"it timed an {self.device}, this model runs on an {device}")
        if self.policy is not None and self.policy != policy_key(policy):
            problems.append(f"it timed {describe_key(self.policy)}, this patch runs {describe_key(policy_key(policy))}")
        if self.block_size is not None and self.block_size != block_size:
            problems.append(f"it timed {self.block_size}-token blocks, this patch uses {block_size}")
        if self.timing != timing:
            problems.append(f"it timed {self.timing} steps, this patch runs {timing} steps")
        return problems

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
            "policy": self.policy,
            "block_size": self.block_size,
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
            policy=data.get("policy", LEGACY_POLICY),  # written before tables said: calibrate timed Quest only
            block_size=data.get("block_size"),
        )

    @classmethod
    def load(cls, path: str | Path | None = None, timing: str = "eager", policy=None) -> CrossoverTable:
        """A table from ``path``, or when ``None`` one shipped with the package for ``timing`` (``"eager"`` or
        ``"graph"``; the module's docstring says where they were measured): :meth:`shipped`'s for ``policy`` where
        one timed it, else Quest's."""
        if path is None:
            return cls.shipped(timing, policy)
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"crossover file {path} is not JSON ({e}): write one with `hf-sparse-kv calibrate`") from e
        table = isinstance(data, dict) and isinstance(data.get("entries"), list)
        if not table:  # the file's contents are wrong, not an argument's type
            raise ValueError(
                f"crossover file {path} holds no crossover table (a JSON object with a list of 'entries'): write one "
                "with `hf-sparse-kv calibrate`"
            )
        return cls.from_json(data)

    @classmethod
    def shipped(cls, timing: str = "eager", policy=None, folder: str | Path | None = None) -> CrossoverTable:
        """The table of ``folder`` (default: the package's ``hf_sparse_kv/data``) measured with ``timing`` and
        ``policy``'s :func:`policy_key` (``crossover_*.json`` files, the first in name order; any block size), else
        the default Quest table of ``timing`` (:data:`DEFAULT_TABLES`)."""
        if timing not in DEFAULT_TABLES:
            raise ValueError(f"timing must be one of {sorted(DEFAULT_TABLES)}, got {timing!r}")
        root = resources.files("hf_sparse_kv.data") if folder is None else Path(folder)
        if policy is not None:
            key = policy_key(policy)
            for entry in sorted(root.iterdir(), key=lambda e: e.name):
                if not (entry.name.startswith("crossover_") and entry.name.endswith(".json")):
                    continue
                data = json.loads(entry.read_text())
                if data.get("timing", "eager") == timing and data.get("policy", LEGACY_POLICY) == key:
                    return cls.from_json(data)
        return cls.from_json(json.loads(root.joinpath(DEFAULT_TABLES[timing]).read_text()))


def budget_fraction(policy, context: int) -> float | None:
    """The fraction of ``context`` a policy's budget keeps (``None`` for a policy without a budget, e.g. Dense): what
    its :meth:`~hf_sparse_kv.policies.Policy.budget_fraction` says."""
    return policy.budget_fraction(context)
