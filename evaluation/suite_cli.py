"""``hf-sparse-kv suite``: the command line of the quality suite (:mod:`evaluation.suite` runs it,
:mod:`evaluation.suite_estimate` prices it, :mod:`evaluation.suite_summary` writes its tables,
:mod:`evaluation.suite_compare` compares two folders' cells)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .kernel_specs import SPECS_ENV
from .suite import SUITES, load_suite, run_suite, run_workers
from .suite import __doc__ as SUITE_DOC
from .suite_estimate import ESTIMATE_NOT_COUNTED, estimate
from .sweep import ResultsDir


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a positive number, not {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    """``hf-sparse-kv suite MODEL --out DIR [--time-limit S] [--summarize] [--set key=value ...]``."""
    import yaml

    from .suite_summary import summarize

    p = argparse.ArgumentParser(prog="hf-sparse-kv suite", description=SUITE_DOC.split("\n\n")[0])
    p.add_argument("model", help=f"one of {sorted(SUITES)} or a suite YAML path")
    p.add_argument("--out", required=True, help="results folder (cells.jsonl, summary.md, plots); resumes")
    p.add_argument("--time-limit", type=float, help="seconds; the run stops cleanly before the next unit after it")
    p.add_argument("--summarize", action="store_true", help="only write tables and plots from DIR/cells.jsonl")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="print rough device minutes per job still to run (no model loaded; priced from --out's finished cells)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="with --estimate: price the whole suite run again from an empty folder (from --out's cells all the same)",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="suite processes sharing the folder, each with its own model, none running a job another took "
        "(a small model's decoding leaves a GPU idle: two Qwen2.5-1.5B workers did ~1.7x the work on an H200)",
    )
    p.add_argument(
        "--compare",
        metavar="OTHER",
        help="only compare --out's cells with their twins in the folder OTHER (retrieval outcomes, perplexity NLL)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (YAML)")
    p.add_argument(
        "--kernel-specs",
        metavar="FILE",
        default=os.environ.get(SPECS_ENV) or None,
        help="Triton specializations built ahead in parallel while the model loads, each new one this run compiles "
        f"appended (on a GPU; evaluation.kernel_specs); default ${SPECS_ENV}",
    )
    a = p.parse_args(argv)
    if a.compare:
        from .suite_compare import compare_folders

        try:
            print(compare_folders(a.out, a.compare), end="")
        except FileNotFoundError as e:
            p.error(str(e))
        return
    overrides = {}
    for item in a.set:
        k, _, v = item.partition("=")
        overrides[k] = yaml.safe_load(v)
    cfg = load_suite(a.model, overrides)
    if a.estimate:
        rows = ResultsDir(a.out).rows() if any(Path(a.out).glob("cells*.jsonl")) else []
        total = 0.0
        for job, sec, from_rows in estimate(cfg, rows=rows, fresh=a.fresh):
            total += sec
            what = job.params.get("variant", "")
            how = "measured" if from_rows else "model"
            print(
                f"{job.task:10} {job.length:6} {what:13} {len(job.labels)} policies @ {','.join(job.budgets):14} "
                f"{sec / 60:6.1f} min  (cumulative {total / 60:6.1f}; {how})"
            )
        print(ESTIMATE_NOT_COUNTED)
        return
    if not a.summarize and a.workers > 1:
        run_workers(cfg, a.out, a.time_limit, a.workers, kernel_specs=a.kernel_specs)
    elif not a.summarize:
        run_suite(cfg, a.out, a.time_limit, kernel_specs=a.kernel_specs)
    print(summarize(a.out, title=str(cfg.get("model"))))


if __name__ == "__main__":
    main()
