"""benchmarks/probe_generate_trace.py on the CPU (no GPU activity there): each row's traced generate() steps and
filled-cache steps, and their tables of CPU ops and runtime calls. No speed is checked here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_traces_each_rows_generate_steps():
    cmd = [sys.executable, "benchmarks/probe_generate_trace.py", "--device", "cpu", "--tiny", "--length", "64",
           "--new-tokens", "8", "--wait", "3", "--active", "3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("generate() steps after 3") == 2  # Quest 1/16, Dense
    assert out.stdout.count("steps on a filled cache after 3") == 2  # the same rows' filled-cache steps
    tables = out.stdout.split("CPU ops by self time")[1:]
    assert len(tables) == 4 and all("aten::" in t for t in tables)
    assert "ProfilerStep" not in out.stdout  # the schedule's own ranges are not ops


def test_too_few_new_tokens_for_the_schedule_is_refused():
    cmd = [sys.executable, "benchmarks/probe_generate_trace.py", "--device", "cpu", "--tiny", "--new-tokens", "8"]
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--new-tokens must exceed" in out.stderr
