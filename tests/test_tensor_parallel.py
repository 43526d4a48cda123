"""Tensor parallelism (transformers' ``tp_plan="auto"`` under ``torchrun``): a patched model whose attention layers
hold half of the heads on each of two ranks decodes as the same model on one device. The checks are in
``tests/tp_check.py``, launched here with ``torchrun --standalone --nproc-per-node 2``: on the CPU over gloo (runs in
CI, ~15 s) and on two GPUs over NCCL (skipped without them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("tp_check.py")


def run_tp_check(device: str, out: Path) -> dict:
    """Launch the check on two ranks of ``device``; its JSON result (the launcher's output in the message if none)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks, also on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(SCRIPT), "--device", device, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.exists(), (
        f"no result from tp_check.py (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    )
    return {**json.loads(out.read_text()), "returncode": proc.returncode}


@pytest.mark.slow
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL ranks)"),
        ),
    ],
)
def test_tensor_parallel_patched_model_matches_one_device(device, tmp_path):
    result = run_tp_check(device, tmp_path / "result.json")
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert result["ok"] and not failed and result["returncode"] == 0, (failed, result["max_abs"])
    assert result["world"] == 2 and result["device"] == device
