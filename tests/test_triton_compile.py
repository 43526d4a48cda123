"""Every Triton kernel builds for sm_90 (H100/H200) on this CPU-only machine: the interpreter tests never compile.

Runs ``tests/compile_sm90.py`` in a fresh process without ``TRITON_INTERPRET`` (the interpreter replaces
``triton.jit`` at import, so the build has to happen in a process that imported Triton normally).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_sm90.py")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, SCRIPT], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all compiled" in proc.stdout
    assert proc.stdout.count("\nok ") >= 20, proc.stdout  # every variant ran (a silently empty list would pass)


def test_quant_tail_builds_the_same_code_at_every_table_width():
    """A static step's wider table must not compile the low-bit keys' tail differently (another reduction order):
    ``compile_sm90.py --widths`` compares the PTX of 2047-, 2049-, 2048- and 2064-block tables."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--widths"], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("same PTX at every table width") == 2, proc.stdout


def test_no_kernel_loads_global_memory_a_byte_at_a_time():
    """Codes (uint8 / float8) must come in as wide vectors: ``compile_sm90.py --loads`` counts each kernel's one-byte
    global loads in its sm_90 PTX over every compiled case (the float8 scorer once had 128 a thread)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--loads"], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "fp8_block_lse_kernel" in proc.stdout and "quant_block_lse_kernel" in proc.stdout, proc.stdout
