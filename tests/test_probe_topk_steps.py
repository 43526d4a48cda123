"""benchmarks/probe_topk_steps.py's replay of the top-k kernel's radix select (no model loaded here)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_topk_steps as probe


def test_keys_keep_the_scores_order():
    s = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    keys = probe.order_keys(s)
    assert torch.all(keys[1:] >= keys[:-1]) and int(keys.min()) >= 0 and int(keys.max()) < 2**32


def test_the_select_stops_once_k_keys_are_above_its_threshold():
    row = torch.randn(513, generator=torch.Generator().manual_seed(0))
    assert probe.select_steps(row, 513) == 0  # every key: nothing to separate
    steps = probe.select_steps(row, 32)
    assert 1 <= steps <= 16
    far = torch.cat([torch.full((32,), 1e6), torch.zeros(481)])  # the k-th and the next apart in the top bits
    assert probe.select_steps(far, 32) < steps
