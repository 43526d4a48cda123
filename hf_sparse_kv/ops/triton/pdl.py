"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's chain of small kernels.

A decode layer runs its Triton kernels back to back on one stream (the KV write, the block scores, the top-k, the
split-KV decode, the merge), each a few microseconds at most, each reading what the one before wrote. Launched with
PDL, a kernel may start (be scheduled, set up its programs) while the one before it drains; its programs then wait
at :func:`await_prior` (``griddepcontrol.wait``) until that kernel has finished and its writes are visible, so
the result is the same as an ordinary launch. Right after the wait a kernel lets its own successor launch
(``griddepcontrol.launch_dependents``): the successor's programs can be scheduled once every program of this one has
started. A CUDA graph captures the launches with their programmatic edges.

The wait sits before a kernel's first load, so every input (made by any kernel before, however far back: each
kernel in the chain waited for its own predecessor before finishing) is complete when read.

On wherever it can be: :func:`use_pdl` is true on CUDA devices of compute capability 9.0 or later, outside Triton's
interpreter, unless the environment sets ``HF_SPARSE_KV_PDL=0`` (read at each launch, so a benchmark can capture
the same step both ways).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "HF_SPARSE_KV_PDL"


@triton.jit
def await_prior(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one has finished and its writes are visible, then let the next
    kernel launch. Nothing without (and nothing under the interpreter, which never sets it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether a kernel on ``device`` is launched with PDL: CUDA, compute capability >= 9.0, not Triton's
    interpreter, and ``HF_SPARSE_KV_PDL`` not ``"0"``."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV) == "0":
        return False
    return _hopper_or_later(device)
