"""What every recipe shares: the YAML config, the policy × budget grid, the results folder that resumes, sharding.

A results folder holds ``config.yaml`` (what ran), ``cells*.jsonl`` (one line per finished cell, appended as it
finishes: a rerun skips every cell already there, so an interrupted run resumes), ``summary.json`` / ``summary.csv``
and the PNG plots. Under ``accelerate launch`` each process takes every ``world``-th unit of work (a window, a
trial) and appends to its own ``cells.rank<r>.jsonl``; the main process writes the summary once all are done.
"""

from __future__ import annotations

import csv
import json
import os
import zlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from hf_sparse_kv.policies import POLICIES, Dense, Policy

from .simulate import check_reuse

RECIPES = ("perplexity", "fidelity", "needle", "qa")

DEFAULTS: dict[str, Any] = {
    "model": "smollm2",
    "dtype": "float32",
    "device": None,
    "text": "essays",
    "block_size": 16,
    "mode": "block",
    "dense_layers": [0, 1],
    "lengths": [2048],
    "budgets": [0.125],
    "policies": [{"name": "dense"}, {"name": "quest"}],
    "seed": 0,
}


def stable_seed(*parts: Any) -> int:
    """A seed from ``parts`` that is the same in every process and run (``hash()`` of a str is not)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def parse_budget(value: Any) -> int | float:
    """``0.125``, ``"1/8"`` -> 0.125 (a fraction of the context); ``2048`` -> 2048 tokens."""
    if isinstance(value, str):
        try:
            value = float(Fraction(value.strip()))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"budget {value!r} is neither a number of tokens nor a fraction like 1/8") from None
    if isinstance(value, float) and value > 1:
        value = int(value)
    return value


def budget_value(budget: float | None, length: int) -> float | None:
    """A budget as a fraction of a ``length``-token context (``None`` for dense)."""
    if budget is None:
        return None
    return budget if isinstance(budget, float) else budget / length


def perplexity_row(
    length: int, window: int, cell: PolicyCell, way: str, nll, kl: float, fidelity, seconds: float, **extra
) -> dict[str, Any]:
    """The raw cell of one (window, policy): ``nll`` ``[N]`` per scored token, ``kl`` the mean KL(dense ‖ policy),
    ``fidelity`` an object with ``recall`` and ``hit_rate`` (or ``None``); ``extra`` keys go first (e.g. the task)."""
    return {
        **extra,
        "length": length,
        "window": window,
        "policy": cell.label,
        "budget": budget_label(cell.budget),
        "budget_value": budget_value(cell.budget, length),
        "way": way,
        "nll_sum": float(nll.sum()),
        "n": int(nll.numel()),
        "kl_mean": float(kl),
        "recall": fidelity.recall if fidelity else None,
        "hit_rate": fidelity.hit_rate if fidelity else None,
        "seconds": seconds,
        **({"reuse": cell.reuse} if cell.reuse > 1 else {}),
    }


def budget_label(budget: float | None) -> str:
    """``0.125`` -> ``"1/8"``, ``2048`` -> ``"2048"``, None -> ``"-"``."""
    if budget is None:
        return "-"
    if isinstance(budget, float):
        f = Fraction(budget).limit_denominator(1024)
        return f"{f.numerator}/{f.denominator}" if f.numerator == 1 or f.denominator > 1 else str(budget)
    return str(budget)


@dataclass
class PolicyCell:
    """One (policy, budget) of the grid; ``label`` names the policy (``name`` from the YAML or its registry name).
    ``reuse``: the policy selects at every ``reuse``-th decode step only, the steps in between reuse that selection
    (an experiment the ``simulate`` way scores: ``SimulateSession.run(reuse=...)``; no decode path runs it)."""

    label: str
    budget: int | float | None
    policy: Policy
    reuse: int = 1

    @property
    def key(self) -> tuple[str, str]:
        return self.label, budget_label(self.budget)


def policy_grid(specs: list[dict[str, Any]], budgets: list[Any]) -> list[PolicyCell]:
    """Every policy spec (``{"name": "quest", "sink": 4, ...}``) at every budget; ``dense`` once, without one.

    A spec may carry its own ``budgets`` list. Names are those of :data:`hf_sparse_kv.policies.POLICIES`, or
    ``"module:Class"`` for a :class:`~hf_sparse_kv.policies.Policy` defined elsewhere (an experiment such as
    ``evaluation.channel_quant:ChannelQuantBlockTopK``; its label defaults to the class name). A
    ``snapkv`` spec may nest a query-aware policy, ``then: {name: quest, ...}``: the grid's budget goes to SnapKV,
    or to the nested policy when the spec fixes SnapKV's own ``budget`` (compress to it, then select per step).
    ``reuse: r`` (a positive int) makes the cells :attr:`PolicyCell.reuse` (label default ``<name>_r<r>``): scored
    the ``simulate`` way only, refused for Dense and for policies that compress the prompt.
    """
    cells = []
    for spec in specs:
        spec = dict(spec) if isinstance(spec, dict) else {"name": spec}
        cls = _policy_class(spec.pop("name", None))
        # "Quest" is labelled "quest"; a class from elsewhere by its own name
        name = next((key for key, value in POLICIES.items() if value is cls), cls.__name__)
        reuse = spec.pop("reuse", 1)
        check_reuse(reuse)
        if reuse > 1 and (cls is Dense or cls.compresses):
            raise ValueError(f"reuse applies to a query-aware selection, not to {cls.__name__}")
        label = spec.pop("label", name if reuse == 1 else f"{name}_r{reuse}")
        if cls is Dense:
            cells.append(PolicyCell(label, None, Dense()))
            continue
        then = spec.pop("then", None)
        fixed = "budget" in spec
        for b in spec.pop("budgets", budgets):
            b = parse_budget(b)
            kwargs = {**spec, "budget": parse_budget(spec["budget"]) if fixed else b}
            if then is not None:
                kwargs["then"] = _nested_policy(then, b if fixed else None)
            cells.append(PolicyCell(label, b, cls(**kwargs), reuse))
    return cells


def decoded_cells(cells: list[PolicyCell]) -> list[PolicyCell]:
    """``cells`` for a runner that decodes through the patched model (needles, QA): raises a ``ValueError`` naming a
    cell with ``reuse`` (scored the ``simulate`` way only)."""
    for c in cells:
        if c.reuse > 1:
            raise ValueError(
                f"cell {c.label!r} reuses selections (reuse={c.reuse}), which only the simulate way scores "
                "(perplexity and fidelity); no decode path runs it"
            )
    return cells


def _nested_policy(spec: dict[str, Any], budget: float | None) -> Policy:
    """The ``then:`` policy of a spec, at ``budget`` (the grid's) or, when ``None``, at the budget it names."""
    spec = dict(spec)
    cls = _policy_class(spec.pop("name"))
    own = spec.pop("budget", None)
    if budget is None and own is None:
        raise ValueError(f"the nested policy {spec} needs a budget when SnapKV's own budget is the grid's")
    return cls(budget=budget if budget is not None else parse_budget(own), **spec)


def _policy_class(name: str) -> type[Policy]:
    """The policy class of ``name``: a key of :data:`~hf_sparse_kv.policies.POLICIES` (``"sink_window"``), the
    class's own name (``"SinkWindow"``), or ``"module:Class"`` naming a :class:`Policy` subclass elsewhere."""
    if isinstance(name, str) and ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"policy {name!r}: cannot import {attr!r} from {module!r} ({e})") from e
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise ValueError(f"policy {name!r} is not a hf_sparse_kv Policy subclass")
        return cls
    by_class = {cls.__name__: cls for cls in POLICIES.values()}
    if name not in POLICIES and name not in by_class:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(POLICIES)} (or the class names {', '.join(by_class)}, "
            "or 'module:Class')"
        )
    return POLICIES.get(name) or by_class[name]


def check_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Raise a ``ValueError``/``TypeError`` for what a recipe would only meet after loading its model: an unknown
    recipe, policy, mode or dtype, a bad budget, block size, length or layer index. Returns ``cfg``."""
    from hf_sparse_kv.attention import MODES
    from hf_sparse_kv.ops.layout import check_block_size

    if cfg["recipe"] not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {cfg['recipe']!r}")
    if not isinstance(cfg["policies"], list) or not isinstance(cfg["budgets"], list):
        raise TypeError("'policies' and 'budgets' must be lists")
    policy_grid(cfg["policies"], cfg["budgets"])  # builds every policy: names, budgets, sink/window checked
    if cfg["mode"] not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {cfg['mode']!r}")
    check_block_size(cfg["block_size"])
    dtypes = ("float32", "bfloat16", "float16", "float64")
    if (cfg.get("dtype") or "float32") not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {cfg['dtype']!r}")
    for key, minimum in (("lengths", 1), ("dense_layers", 0)):
        values = cfg[key]
        if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise TypeError(f"'{key}' must be a list of ints, got {values!r}")
        if any(v < minimum for v in values):
            raise ValueError(f"'{key}' must hold ints >= {minimum}, got {values!r}")
    return cfg


def load_config(path_or_dict: str | Path | dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A recipe's config: the YAML file (or dict) over :data:`DEFAULTS`, then ``overrides``."""
    import yaml

    raw = path_or_dict if isinstance(path_or_dict, dict) else yaml.safe_load(Path(path_or_dict).read_text())
    cfg = {**DEFAULTS, **(raw or {}), **(overrides or {})}
    if "recipe" not in cfg:
        raise ValueError("a recipe config needs 'recipe': perplexity, fidelity, needle or qa")
    if "output" not in cfg:
        cfg["output"] = f"results/{cfg['recipe']}"
    return cfg


@dataclass
class Shard:
    """This process's share of the work (``rank`` of ``world``), from accelerate's state when launched by it."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"
    state: Any = field(default=None, repr=False)

    @classmethod
    def detect(cls, device: str | None = None) -> Shard:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch
            from accelerate import PartialState

            state = PartialState(cpu=device == "cpu" or not torch.cuda.is_available())
            return cls(state.process_index, state.num_processes, str(state.device), state)
        return cls(0, 1, device or "cpu")

    def mine(self, index: int) -> bool:
        return index % self.world == self.rank

    def wait(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()

    @property
    def main(self) -> bool:
        return self.rank == 0


class ResultsDir:
    """The results folder: finished cells (read from every ``cells*.jsonl``: each shard's or suite worker's file),
    appended one JSON line at a time to this process's file (``name``; default ``cells.jsonl``, or the shard's).

    ``stamp``: fields written into every appended row that the row does not set itself (the suite's ``device`` and
    ``date``: where and when a cell ran, so that cells from different machines can be told apart later)."""

    def __init__(
        self,
        path: str | Path,
        shard: Shard | None = None,
        stamp: dict[str, Any] | None = None,
        name: str | None = None,
    ):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.shard = shard or Shard()
        self.stamp = dict(stamp or {})
        if name is not None and not (name.startswith("cells") and name.endswith(".jsonl") and "/" not in name):
            raise ValueError(f"a results file is named cells*.jsonl (every such file is read back), not {name!r}")
        default = "cells.jsonl" if self.shard.world == 1 else f"cells.rank{self.shard.rank}.jsonl"
        self.file = self.path / (name or default)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for f in sorted(self.path.glob("cells*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by an interrupted write
                        continue
        return out

    def done(self, key_fields: tuple[str, ...]) -> set[tuple]:
        return {tuple(r.get(k) for k in key_fields) for r in self.rows()}

    def append(self, row: dict[str, Any]) -> None:
        with self.file.open("a") as f:
            f.write(json.dumps({**row, **{k: v for k, v in self.stamp.items() if k not in row}}) + "\n")
            f.flush()

    def write_summary(self, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
        (self.path / "summary.json").write_text(json.dumps({**(extra or {}), "rows": rows}, indent=1))
        if rows:
            keys = list(dict.fromkeys(k for r in rows for k in r))
            with (self.path / "summary.csv").open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(rows)

    def save_config(self, cfg: dict[str, Any]) -> None:
        import yaml

        if self.shard.main:
            (self.path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def progress(iterable, total: int, desc: str, shard: Shard):
    """A tqdm bar on stderr (one per process, labelled by rank when sharded)."""
    from tqdm.auto import tqdm

    label = desc if shard.world == 1 else f"{desc} [rank {shard.rank}]"
    return tqdm(iterable, total=total, desc=label, position=shard.rank, dynamic_ncols=True)
