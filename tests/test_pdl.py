"""Programmatic dependent launch of the decode chain's kernels (``hf_sparse_kv/ops/triton/pdl.py``): when it is
chosen, and (on a Hopper GPU) that the chain gives bit-identical results with and without it, eager and captured.
The kernels' build with the wait is checked for sm_90 on the CPU by ``tests/compile_sm90.py``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_sparse_kv.ops.triton import block_scores, decode_blocks, paged_write, topk_indices
from hf_sparse_kv.ops.triton.pdl import ENV, use_pdl

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_never_off_a_gpu_nor_when_switched_off(monkeypatch):
    assert not use_pdl(torch.device("cpu"))
    monkeypatch.setenv(ENV, "0")
    assert not use_pdl(torch.device("cuda", 0))  # decided before any device query


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case")
def test_not_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ENV, raising=False)
    assert not use_pdl(torch.device("cuda", 0))


def chain(c):
    """One decode layer's chain: write a token, score, select, attend (each kernel reads the one before's output)."""
    paged_write(c["k"], c["v"], c["kmin"], c["kmax"], c["kmean"], c["table"], c["pos"], c["k1"], c["v1"])
    scores = block_scores(c["q"], c["kmin"], c["kmax"], c["kmean"], c["table"], c["lens"], 16, "quest", c["z"], 4, 32)
    sel = topk_indices(scores, 64)
    return decode_blocks(c["q"], c["k"], c["v"], c["table"], c["lens"], c["z"], sel, c["z"], c["z"], 0.088)


def case(B=2, H=8, G=4, D=128, L=16384):
    g = torch.Generator(device="cuda").manual_seed(0)
    MB = L // 16 + 1
    NB = B * MB
    bf = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    k, v = torch.randn(NB, H, 16, D, **bf), torch.randn(NB, H, 16, D, **bf)
    c = {
        "q": torch.randn(B, H * G, D, **bf),
        "k": k,
        "v": v,
        "kmin": k.amin(2),
        "kmax": k.amax(2),
        "kmean": k.float().mean(2).bfloat16(),
        "table": torch.randperm(NB, device="cuda", generator=g).view(B, MB).int(),
        "lens": torch.full((B,), L + 1, dtype=torch.int32, device="cuda"),
        "pos": torch.full((B,), L, dtype=torch.int32, device="cuda"),
        "z": torch.zeros(B, dtype=torch.int32, device="cuda"),
        "k1": torch.randn(B, H, 1, D, **bf),
        "v1": torch.randn(B, H, 1, D, **bf),
    }
    return c


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability >= 9.0")
def test_the_chain_is_the_same_with_and_without(monkeypatch):
    """Eager and replayed from a CUDA graph, with PDL, equal the chain launched without it, bit for bit."""
    assert use_pdl(torch.device("cuda"))
    monkeypatch.setenv(ENV, "0")
    base = case()
    ref = chain({**base, "k": base["k"].clone(), "v": base["v"].clone()})
    monkeypatch.delenv(ENV)
    c = {**base, "k": base["k"].clone(), "v": base["v"].clone()}
    assert torch.equal(chain(c), ref)
    c = {**base, "k": base["k"].clone(), "v": base["v"].clone()}
    chain(c)  # compiled, then captured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(c)
    for _ in range(3):
        c["k"].copy_(base["k"])
        c["v"].copy_(base["v"])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
