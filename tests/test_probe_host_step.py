"""benchmarks/probe_host_step.py on the CPU (no graphs there, so no replay columns): each row, the ``--signature``
rows and the profile's table. No speed is checked here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_times_each_row_and_profiles_it():
    cmd = [sys.executable, "benchmarks/probe_host_step.py", "--device", "cpu", "--layers", "2", "--length", "64",
           "--steps", "2", "--warmup", "1", "--profile", "1", "--signature"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith(" row"))) + 1 :]
    assert [line.split("  ")[0].strip() for line in table] == ["Dense", "Quest 1/16", "Dense (sig)", "Quest 1/16 (sig)"]
    assert all(len(line.split()) >= 4 for line in table)  # replays, wall and forward times
    assert out.stdout.count("cum us/step") == 4 and "patch.py" in out.stdout


def test_the_probe_times_a_real_generate():
    """``--generate``: each row's median generate() step as a column, and its profile's table."""
    cmd = [sys.executable, "benchmarks/probe_host_step.py", "--device", "cpu", "--layers", "2", "--length", "32",
           "--steps", "2", "--warmup", "1", "--profile", "1", "--generate", "5"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith(" row"))
    assert header.split()[-1] == "generate_us"
    table = lines[lines.index(header) + 1 :]
    assert [float(line.split()[-1]) > 0 for line in table] == [True, True]
    assert out.stdout.count("cProfile of generate()") == 2


def test_the_cold_probe_splits_the_host_part_of_a_captured_step_on_the_cpu():
    """benchmarks/probe_host_cold.py: the captured path's host part (the replay a no-op) by stage, per row and wait;
    every stage is stamped (a step that left the captured path would have no stages), and the stages cover the host
    part (each step's stages add up to it exactly; the medians printed, within a fifth)."""
    cmd = [sys.executable, "benchmarks/probe_host_cold.py", "--layers", "2", "--length", "64", "--steps", "3",
           "--waits", "none,sleep", "--wait-ms", "1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith(" row"))
    assert header.split()[2:] == ["hook_us", "checks_us", "plan_us", "fill_us", "launch_us", "host_us"]
    table = [line.split() for line in lines[lines.index(header) + 1 :]]
    assert [(r[0] + (" " + r[1] if r[1] == "1/16" else ""), r[-7]) for r in table] == [
        ("Dense", "none"), ("Quest 1/16", "none"), ("Dense", "sleep"), ("Quest 1/16", "sleep")]  # fmt: skip
    for r in table:
        stages, host = list(map(float, r[-6:-1])), float(r[-1])
        assert all(s > 0 for s in stages) and abs(sum(stages) - host) <= 0.2 * host
