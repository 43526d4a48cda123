"""What a suite still costs on a GPU: :func:`estimate` prices each job of a plan (``hf-sparse-kv suite ...
--estimate``) from the finished cells' own seconds where there are some, else from a model of the steps; the
medians per kind of unit it reads (:func:`measured_seconds`, :func:`marginal_seconds`, :func:`batch_part_per_prompt`,
:func:`prefill_per_prompt`). For planning a device session, not a measurement."""

from __future__ import annotations

from typing import Any

from hf_sparse_kv.ops.layout import cdiv

from .suite import (
    Job,
    _done_keys,
    _job_kind,
    _needle_params,
    _qa_params,
    _reuses_graphs,
    _select,
    _units,
    batch_size,
    cells_of,
    decode_way,
    decoded,
    plan,
)

# What --estimate leaves out, printed under its table: measured on the H200 on 2026-12-02 as a suite call's own
# seconds less its cells' (and the dense passes no row holds): 77 s on Qwen2.5-1.5B, ~80 s on Gemma-3-270M.
ESTIMATE_NOT_COUNTED = "not counted: loading the model and the first launches' compiles, ~1.3 min a call on the H200"

# (layers, parameters) of the suite's models, for :func:`estimate`
SHAPES = {"smollm2": (30, 0.135e9), "gemma3-270m": (18, 0.27e9), "qwen2.5-coder-1.5b": (28, 1.54e9)}
# the suite's models with sliding-window layers: SnapKV starts from a dense prefill up to its window there
SLIDING = frozenset({"gemma3-270m"})


def _row_kind(r: dict[str, Any]) -> tuple:
    """:func:`_job_kind` of the job that wrote the finished cell ``r``."""
    extra = r.get("way", "simulate") if r["task"] == "perplexity" else r.get("variant", "")
    return (r["task"], r["length"], extra)


def _medians(pairs) -> dict[tuple, float]:
    """``{key: median of its values}`` of ``(key, value)`` pairs."""
    import statistics

    by: dict[tuple, list[float]] = {}
    for key, value in pairs:
        by.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in by.items()}


def measured_seconds(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Median ``seconds`` per (unit, cell) of the finished cells (what the machine that ran them took; a row
    without ``seconds`` is left out), by :func:`_row_kind` and by that kind plus the policy's label."""

    def pairs():
        for r in rows:
            if r.get("task") in ("perplexity", "needle", "qa") and isinstance(r.get("seconds"), (int, float)):
                key, sec = _row_kind(r), float(r["seconds"])
                yield key, sec
                yield (*key, r.get("policy")), sec

    return _medians(pairs())


ONCE_PHASES = ("build", "prefill")  # what a needle / QA batch spends once whatever its cells


def _phase_seconds(r: dict[str, Any], names: tuple[str, ...]) -> float:
    """The seconds of a needle / QA row's batch in the ``phases`` ``names`` (absent ones: 0)."""
    return sum(float(r["phases"].get(name, 0.0)) for name in names)


def _fixed_part(r: dict[str, Any]) -> float | None:
    """The share of a needle / QA cell's ``seconds`` that its batch spent once for all its cells (waiting for the
    prompts and prefilling them: :data:`ONCE_PHASES` over the sum of the phases), or ``None`` for a row without
    ``phases`` (or with none timed)."""
    phases = r.get("phases")
    if r.get("task") not in ("needle", "qa") or not isinstance(phases, dict):
        return None
    total = sum(float(v) for v in phases.values())
    return _phase_seconds(r, ONCE_PHASES) / total if total > 0 else None


def marginal_seconds(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """:func:`measured_seconds` of the needle / QA cells that carry their batch's ``phases``, less the share their
    batch spent once for all its cells (:func:`_fixed_part`): what one more cell of a batch costs per prompt,
    decoding (and copying the prefill) only. The batch's once-for-all part is :func:`batch_part_per_prompt`."""

    def pairs():
        for r in rows:
            part = _fixed_part(r)
            if part is not None and isinstance(r.get("seconds"), (int, float)):
                sec = float(r["seconds"]) * (1.0 - part)
                yield _row_kind(r), sec
                yield (*_row_kind(r), r.get("policy")), sec

    return _medians(pairs())


def _per_prompt(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[tuple, float]:
    """Median seconds per prompt of the batch phases ``names`` of the finished needle / QA cells that carry their
    batch's ``phases`` (a prefill among them) and ``batch``, by :func:`_row_kind`."""
    return _medians(
        (_row_kind(r), _phase_seconds(r, names) / int(r["batch"]))
        for r in rows
        if r.get("task") in ("needle", "qa")
        and isinstance(r.get("phases"), dict)
        and "prefill" in r["phases"]
        and r.get("batch")
    )


def batch_part_per_prompt(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Median seconds per prompt that a needle / QA batch spends once whatever its cells (:data:`ONCE_PHASES` over
    ``batch``), by :func:`_row_kind`; rows without ``phases`` or ``batch`` are left out."""
    return _per_prompt(rows, ONCE_PHASES)


def prefill_per_prompt(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """Median prefill seconds per prompt of the finished needle / QA cells that carry their batch's ``phases``, by
    :func:`_row_kind`: what one more prefill of a batch costs each of its prompts (a batch that also ran a policy's
    own prefill counts it too; such batches are few)."""
    return _per_prompt(rows, ("prefill",))


def estimate(
    cfg: dict[str, Any],
    step_ms_per_layer: float = 1.6,
    tflops: float = 150.0,
    rows: list[dict[str, Any]] | None = None,
    fresh: bool = False,
    static_step_ms_per_layer: float = 0.3,
    simulate_ms_per_layer: float = 6.0,
) -> list[tuple[Job, float, bool]]:
    """Rough device seconds per job, for planning a GPU session (not a measurement): ``(job, seconds, measured)``.

    Counts only the (unit, cell) pairs still to run: not in ``rows`` (the results folder's finished cells; with
    ``fresh``, none: the whole suite run again from an empty folder, still priced from ``rows``) and not run by an
    earlier job of the plan (the tiers repeat cells). A job whose kind of unit (:func:`_job_kind`) has
    finished cells in ``rows`` is priced at their median seconds per unit, the policy's own median where it has some
    (``measured``: True; a policy that prefills on its own, SnapKV, without finished cells of the kind pays the kind's
    median plus a prompt's share of a prefill, measured (:func:`prefill_per_prompt`) or the model's; where the
    kind's needle / QA cells carry their batch's ``phases``, a cell is priced at its marginal seconds
    (:func:`marginal_seconds`: its share of the batch's decoding) and each prompt of the job with cells left adds its
    batch's once-for-all part (:func:`batch_part_per_prompt`: building and prefilling it) once, so a plan that
    prefills each batch once for every cell (``one_pass``) costs less than the tiers, which prefill it per tier; a perplexity
    window adds the dense pass it runs where no row's ``seconds`` holds it: every window of the decode way, at the
    kind's median, and a window whose dense cell is done, at the dense cell's median); otherwise a model:
    eager decode steps bound by the host at ``step_ms_per_layer`` per layer whatever the batch (about what
    ``benchmarks/RESULTS.md`` measured on the H200: 50-60 ms per step of a 32-layer model), static (captured) steps
    at ``static_step_ms_per_layer`` (an H100, 2026-12-05: Qwen2.5's captured steps of 8-16 prompts at 8K-32K took
    0.04-0.06 s for 8 steps of 28 layers, the exact scorers' 0.15-0.2 s), a SnapKV cell one eager step more (its
    first; none on a kept slot, ``reuse_graphs``) and, on a model with sliding-window layers (:data:`SLIDING`), one more prefill per observation window a
    batch (elsewhere it starts from the shared prefill, its window forwarded again: not counted), prefills at
    ``tflops`` effective, a ``simulate`` cell at ``simulate_ms_per_layer`` per layer (twice that with fidelity; the
    same H100 on random weights of Qwen2.5's shape at 32K: 6 ms a layer for dense, 12-19 with fidelity), scaled by
    the share of the job's units left. A needle or QA cell decoded the way this config decodes it (``decode``: ``"static"`` or ``"eager"``,
    :func:`decode_way`) prices its key before cells decoded the other way, which price a key only where none does
    (captured steps ran Qwen2.5's needle jobs ~2.3x faster than their eager cells). Policies scored with reference
    ops (an experiment named ``module:Class``) run slower than the model says; their measured rows say by how much.
    Rows recorded on the CPU (``device: "cpu"``) count as done but price nothing: the estimate is for a GPU (rows
    written before cells carried their device are taken as they are)."""
    layers, params = SHAPES.get(cfg["model"], (32, 1e9))
    step = layers * step_ms_per_layer / 1000
    static_step = layers * static_step_ms_per_layer / 1000

    def prefill(tokens: int) -> float:
        return 2 * params * tokens / (tflops * 1e12) + layers * 0.002

    cells = cells_of(cfg)
    done = set() if fresh else _done_keys(rows or [])
    priced = [r for r in rows or [] if r.get("device") != "cpu"]
    by_label = {c.label: c for c in cells}

    def decoded_as_here(r: dict[str, Any]) -> bool:
        """Whether a finished cell was decoded the way this config would decode it (a needle / QA cell or a
        perplexity cell of the ``decode`` way: its ``decode``, ``"eager"`` where it says none, against
        :func:`decode_way`; every other cell: yes)."""
        if r.get("task") == "perplexity" and r.get("way") == "decode":
            part = {"static": bool(cfg.get("static", False)), **(cfg.get("perplexity") or {})}
        elif r.get("task") in ("needle", "qa"):
            part = _needle_params(cfg, r.get("variant", "single")) if r["task"] == "needle" else _qa_params(cfg)
        else:
            return True
        cell = by_label.get(r.get("policy"))
        return cell is not None and r.get("decode", "eager") == decode_way(part, cell)

    # cells decoded as this config decodes (captured or eager) price first, the others where none of a key is
    here = [r for r in priced if decoded_as_here(r)]
    measured = {**measured_seconds(priced), **measured_seconds(here)}
    marginal = {**marginal_seconds(priced), **marginal_seconds(here)}
    per_prompt = batch_part_per_prompt(priced)
    own_prefill = prefill_per_prompt(priced)
    compressing = {c.label for c in cells if c.policy.compresses}

    def share_of_prefill(job: Job, key: tuple) -> float:
        """Seconds of one more prefill per prompt of ``job`` (of kind ``key``): measured, else the model's (a
        perplexity job's own prefills are in its kind's seconds already)."""
        if key in own_prefill or job.task == "perplexity":
            return own_prefill.get(key, 0.0)
        part = _needle_params(cfg, job.params["variant"]) if job.task == "needle" else _qa_params(cfg)
        b = batch_size(part.get("batch"), job.length)
        return prefill(b * job.length) / b

    def dense_passes(job: Job, key: tuple, left: list[tuple]) -> float:
        """Seconds of the dense pass a perplexity job runs in each window with cells left (the reference of their
        KL) that no row's ``seconds`` holds: the decode way decodes dense beside every batch and writes no dense row
        (priced as one more cell of the kind, per window); the simulate way reruns the dense cell, which also builds
        the session the policies share, where the window's dense cell is done (priced at the dense cell's median)."""
        if job.task != "perplexity":
            return 0.0
        windows = {u[2] for u in left}
        if key[2] == "decode":
            return len(windows) * measured[key]
        with_dense = {u[2] for u in left if u[-2] == "dense"}
        return len(windows - with_dense) * measured.get((*key, "dense"), 0.0)

    out = []
    for job in plan(cfg):
        units = _units(cfg, job, cells)
        left = [u for u in units if u not in done]
        done.update(left)
        key = _job_kind(cfg, job, cells)
        if key in measured:  # each unit at its policy's median when that policy has finished cells of this kind,
            # else the kind's, plus its own prefill's share for a policy that compresses the prompt, plus the dense
            # passes no row carries; where the kind's cells carry their batch's phases, each cell at its marginal
            # seconds and each unit (prompt) of the job with cells left once at its batch's prefill
            extra = share_of_prefill(job, key) if compressing & {u[-2] for u in left} else 0.0
            price, once = (marginal, per_prompt[key]) if key in marginal and key in per_prompt else (measured, 0.0)
            sec = sum(price.get((*key, u[-2]), price[key] + extra * (u[-2] in compressing)) for u in left)
            sec += once * len({u[:-2] for u in left})
            out.append((job, sec + dense_passes(job, key, left), True))
            continue
        mine = [c for c in _select(cells, job) if c.budget is not None]
        if job.task == "perplexity":
            p = {"windows": 16, "scored": 256, "batch": 1, "fidelity": True, **cfg.get("perplexity", {})}
            if any(decoded(cfg, c.policy) for c in mine):
                batches = cdiv(p["windows"], batch_size(p["batch"], job.length))
                b = batch_size(p["batch"], job.length)
                sec = batches * (1 + len(mine)) * (prefill(b * job.length) + p["scored"] * step)
            else:
                sim = layers * simulate_ms_per_layer / 1000
                cost = [sim * (2 if p["fidelity"] and not c.policy.compresses else 1) for c in mine]
                sec = p["windows"] * (prefill(job.length) + sim + sum(cost))
        else:
            part = _needle_params(cfg, job.params["variant"]) if job.task == "needle" else _qa_params(cfg)
            units_per_cell = int(part["trials"]) if job.task == "needle" else int(part["items"]) * len(part["tasks"])
            b = batch_size(part.get("batch"), job.length)
            new = int(part.get("new_tokens", 8)) + 1
            dense_here = "dense" in job.labels and job.labels[0] == "dense" and len(job.budgets) == 1
            decoding = mine + [c for c in cells if c.budget is None][: int(dense_here)]
            steps = sum(new * (static_step if decode_way(part, c) == "static" else step) for c in decoding)
            squeezing = [c.policy for c in mine if c.policy.compresses]
            windows = len({getattr(q, "observe", None) for q in squeezing}) if cfg["model"] in SLIDING else 0
            eager_first = 0 if _reuses_graphs(part) else len(squeezing)  # a kept slot steps SnapKV statically
            per_batch = prefill(b * job.length) * (1 + windows) + steps + eager_first * step
            sec = cdiv(units_per_cell, b) * per_batch
        out.append((job, sec * len(left) / max(1, len(units)), False))
    return out
