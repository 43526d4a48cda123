"""Several suite processes on one results folder (``hf-sparse-kv suite MODEL --out DIR --workers N``,
:func:`evaluation.suite.run_workers`): the claims, the cell keys and the merge they share, standard library only.

A small model's captured decode steps leave a large GPU idle between launches: on one H200, two Qwen2.5-1.5B suite
processes side by side did about 1.7x the work of one per device-minute (evaluation/RESULTS.md, 2026-12-03). Each
worker is a process of its own (``spawn``: each loads its own model, CUDA included) running :func:`~evaluation.suite.
run_suite` on the same folder and config; a worker takes a job only after claiming it (:class:`JobClaims`: one file
per job, created exclusively, in a folder of this invocation), so no job runs twice, and a worker that finishes early
takes the next unclaimed one. Each writes its cells to ``cells.w<k>.jsonl`` beside ``cells.jsonl`` (every
``cells*.jsonl`` counts as done, so a rerun resumes whatever was stopped), and when all have exited their lines are
appended to ``cells.jsonl`` and their files removed (:func:`merge_worker_cells`).

A job claimed by a worker that died (out of memory, say) is not taken by another worker in the same invocation; its
finished cells are kept and the next invocation runs the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

WORKER_FILE = "cells.w{}.jsonl"


def cell_key(row: dict[str, Any]) -> tuple | None:
    """The unit and cell a suite row finishes (``(*unit, policy, budget)``, as :func:`evaluation.suite._job_units`
    names units), or ``None`` for a row of no suite task. Standard library only, like this module's merge: the
    snapshot of a running suite's cells (recipes/device_call.sh) runs on any ``python3``."""
    cell = (row.get("policy"), row.get("budget"))
    if row.get("task") == "perplexity":
        return ("perplexity", row["length"], row["window"], *cell)
    if row.get("task") == "needle":
        return ("needle", row["length"], row["variant"], row["trial"], *cell)
    if row.get("task") == "qa":
        return ("qa", row["length"], row["qa_task"], row["item"], *cell)
    return None


class JobClaims:
    """Claims on a suite's jobs shared by processes on one machine: ``claims(i)`` is ``True`` for exactly one caller
    per job index ``i`` (an exclusive create of ``folder/i``)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, index: int) -> bool:
        try:
            os.close(os.open(self.folder / str(int(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def _worker_files(out: Path) -> list[Path]:
    return sorted(out.glob(WORKER_FILE.format("*")), key=lambda f: int(f.name.split(".")[1][1:]))


def _new_lines(out: Path, files: list[Path]) -> list[str]:
    """The complete lines of ``files`` (in order) whose cell is not in ``out/cells.jsonl`` nor earlier among them."""
    main = out / "cells.jsonl"
    seen = set()
    for line in main.read_text().splitlines() if main.exists() else []:
        try:
            seen.add(cell_key(json.loads(line)))
        except json.JSONDecodeError:
            continue
    lines = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                key = cell_key(json.loads(line))
            except json.JSONDecodeError:
                continue
            if key is None or key not in seen:
                lines.append(line)
                seen.add(key)
    return lines


def _joined(main: Path, lines: list[str]) -> str:
    """``lines`` as text to append to ``main`` (after a last line cut by a kill, on a line of their own)."""
    cut = main.exists() and main.stat().st_size > 0 and not main.read_bytes().endswith(b"\n")
    return "\n" * cut + "\n".join(lines) + "\n" if lines else ""


def merge_worker_cells(out: str | Path) -> int:
    """Append the complete lines of every ``cells.w*.jsonl`` in ``out`` to ``out/cells.jsonl`` (in the workers'
    order) and remove those files. A line cut by an interrupted write is dropped, as :class:`~evaluation.sweep.
    ResultsDir` would skip it, and so is a cell already there (:func:`cell_key`): two workers'
    jobs may share cells (dense's, or a tier's first budget) and both compute one that neither had found done when
    it started. Returns the number of lines appended."""
    out = Path(out)
    files = _worker_files(out)
    lines = _new_lines(out, files)
    if lines:
        main = out / "cells.jsonl"
        text = _joined(main, lines)
        with main.open("a") as dest:
            dest.write(text)
    for f in files:
        f.unlink()
    return len(lines)


def snapshot(out: str | Path, dest: str | Path) -> int:
    """Write to ``dest`` what ``out/cells.jsonl`` would hold after :func:`merge_worker_cells`, leaving ``out`` as
    it is (for copying a running suite's cells off the machine: recipes/device_call.sh); returns the lines added to
    ``cells.jsonl``'s. ``dest`` is replaced in one rename."""
    out, dest = Path(out), Path(dest)
    main = out / "cells.jsonl"
    lines = _new_lines(out, _worker_files(out))
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text((main.read_text() if main.exists() else "") + _joined(main, lines))
    tmp.replace(dest)
    return len(lines)


if __name__ == "__main__":  # python -m evaluation.suite_workers snapshot DIR DEST
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "snapshot":
        sys.exit("usage: python -m evaluation.suite_workers snapshot RESULTS_DIR DEST_FILE")
    snapshot(sys.argv[2], sys.argv[3])
