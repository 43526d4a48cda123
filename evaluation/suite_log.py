"""Where a suite run's time went, read from its log: per job, the batches and their phases' seconds summed.

The suite prints a line per job (``[suite] needle 8192 {'variant': 'single'} ... @ 1/8,1/16,1/32``, since
2026-12-06 ending ``(t+123.4 s)``: the time since the run started), a line per needle / QA batch (``[suite]
needle 8192: 16 prompts x 22 cells: build 0.84 s, prefill 4.42 s, copy 0.42 s, decode 29.84 s``) and its cells'
own seconds with the graphs each captured (``token_topk@1/32 5.59 s (2 graphs 5.54 s)``). Perplexity jobs print no
batch lines (their cells' ``seconds`` in ``cells.jsonl`` say what they took); the ``wall s`` column, read from the
stamps (a job's start to the next job's, or to the run's last line, ``[suite] finished: {... 'seconds': ...}``),
gives every job's time, perplexity's included, and where the model was loaded (``[suite] MODEL loaded (t+X s)``)
a line under the table says when.

    python -m evaluation.suite_log evaluation/results/suite_qwen2.5_grid_timed5/log_run_2026-12-06_h100.txt
    python -m evaluation.suite_log LOG_CALL1 LOG_CALL2   # a run over several calls: the jobs of all, in order

A job that continues in a later log (a run resumed by the next call) is summed across them.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

JOB = re.compile(r"\[suite\] (perplexity|needle|qa) (\d+)\s*(\{[^}]*\})?")
VARIANT = re.compile(r"'variant': '(\w+)'")
STARTED = re.compile(r"\(t\+([\d.]+) s\)\s*$")
LOADED = re.compile(r"^\[suite\] \S+ loaded \(t\+([\d.]+) s\)")
ENDED = re.compile(r"^\[suite\] (?:finished|stopped|done with)[^{]*\{.*'seconds': ([\d.]+)")
BATCH = re.compile(
    r"(\d+) prompts x (\d+) cells: build ([\d.]+) s, prefill ([\d.]+) s, copy ([\d.]+) s, decode ([\d.]+) s"
)
CAPTURE = re.compile(r"\S+@\S+ [\d.]+ s \((\d+) graphs ([\d.]+) s\)")
PHASES = ("build", "prefill", "copy", "decode")


@dataclass
class JobTime:
    """One job's batches in a log: their count and prompts, the phases' seconds summed, the first batch's phases,
    the graphs its cells captured and their seconds, and when it started (seconds since its run started, where the
    log says so)."""

    name: str
    batches: int = 0
    prompts: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    first: dict[str, float] | None = None
    graphs: int = 0
    capture: float = 0.0
    started: float | None = None
    wall: float | None = None  # from its start to the next stamp, summed over its logs (None: a part unknown)
    parts: int = 0  # its starts seen, with a stamp
    closed: int = 0  # those whose end a stamp gave

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def close(self, start: float, end: float) -> None:
        self.wall = (self.wall or 0.0) + end - start
        self.closed += 1

    @property
    def wall_known(self) -> float | None:
        """:attr:`wall` when every part of the job had a start and an end stamp, else ``None``."""
        return self.wall if self.parts and self.closed == self.parts else None


def job_name(line: str) -> str | None:
    """``"needle single 8192"``, ``"qa 32768"``, ``"perplexity 8192"`` for a job line, else ``None``."""
    m = JOB.match(line)
    if not m or "stopped" in line or "finished" in line:
        return None
    v = VARIANT.search(m.group(3) or "")
    return " ".join(x for x in (m.group(1), v.group(1) if v else "", m.group(2)) if x)


def _lines(path: str | Path) -> list[str]:
    """A log's lines (carriage returns of progress bars taken as line ends)."""
    return Path(path).read_text(errors="replace").replace("\r", "\n").splitlines()


def read_logs(paths: list[str | Path]) -> list[JobTime]:
    """The jobs of the suite logs ``paths`` (in order), each once, in the order they first appear."""
    jobs: dict[str, JobTime] = {}
    for path in paths:
        job, open_at = None, None  # the job in the log, and its start stamp while its end is not seen
        for line in _lines(path):
            name = job_name(line)
            ended = ENDED.search(line)
            if (name is not None or ended) and job is not None and open_at is not None:
                m = STARTED.search(line) if name is not None else ended
                if m:
                    job.close(open_at, float(m.group(1)))
                open_at = None
            if name is not None:
                job = jobs.setdefault(name, JobTime(name))
                m = STARTED.search(line)
                if m:
                    job.started = float(m.group(1)) if job.started is None else job.started
                    job.parts += 1
                    open_at = float(m.group(1))
                continue
            if job is None:
                continue
            m = BATCH.search(line)
            if m:
                phases = dict(zip(PHASES, map(float, m.groups()[2:])))
                job.batches += 1
                job.prompts += int(m.group(1))
                for k, v in phases.items():
                    job.seconds[k] += v
                job.first = job.first or phases
            elif "per cell:" in line:
                for n, s in CAPTURE.findall(line):
                    job.graphs += int(n)
                    job.capture += float(s)
    return list(jobs.values())


def loaded_at(paths: list[str | Path]) -> list[float]:
    """When each log's run had its model loaded (seconds since it started), for the logs that say so."""
    out = []
    for path in paths:
        for line in _lines(path):
            m = LOADED.search(line)
            if m:
                out.append(float(m.group(1)))
    return out


def table(jobs: list[JobTime]) -> str:
    """A markdown table of ``jobs``, a row of their sums last."""
    head = (
        "| job | started s | wall s | batches | prompts | build s | prefill s | copy s | decode s | total s "
        "| first batch s | graphs (s) |"
    )
    rows = [head, "| " + " | ".join(["---"] * 12) + " |"]
    for j in jobs:
        started = f"{j.started:.1f}" if j.started is not None else "–"
        wall = f"{j.wall_known:.1f}" if j.wall_known is not None else "–"
        first = f"{sum(j.first.values()):.1f}" if j.first else "–"
        cells = [f"{j.seconds[k]:.1f}" for k in PHASES]
        rows.append(
            f"| {j.name} | {started} | {wall} | {j.batches} | {j.prompts} | {' | '.join(cells)} | {j.total:.1f} | {first} | "
            f"{j.graphs} ({j.capture:.1f}) |"
        )
    sums = [f"{sum(j.seconds[k] for j in jobs):.1f}" for k in PHASES]
    total = sum(j.total for j in jobs)
    graphs, capture = sum(j.graphs for j in jobs), sum(j.capture for j in jobs)
    batches, prompts = sum(j.batches for j in jobs), sum(j.prompts for j in jobs)
    walls = [j.wall_known for j in jobs]
    wall = f"{sum(walls):.1f}" if walls and None not in walls else "–"
    rows.append(
        f"| **all** | | {wall} | {batches} | {prompts} | {' | '.join(sums)} | {total:.1f} | | {graphs} ({capture:.1f}) |"
    )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m evaluation.suite_log", description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="suite logs, in the order the calls ran")
    a = p.parse_args(argv)
    missing = [x for x in a.logs if not Path(x).is_file()]
    if missing:
        p.error(f"no such log: {', '.join(missing)}")
    print(table(read_logs(a.logs)), end="")
    for t in loaded_at(a.logs):
        print(f"model loaded at t+{t:.1f} s")


if __name__ == "__main__":
    main()
