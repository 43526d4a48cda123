"""The steps of ``tests/test_kernel_specs.py``'s check that specializations recorded in one process and built ahead
in others are what a later launch finds in Triton's cache, on a machine without a GPU: every launch compiles for
sm_90 and runs nothing (``compile_sm90.py``'s ``compile_only``). Each step runs in its own process;
``$TRITON_CACHE_DIR`` names the cache.

    python tests/kernel_specs_sm90.py record SPECS     # launch two ops, recording their specializations in SPECS
    python tests/kernel_specs_sm90.py prebuild SPECS   # build SPECS ahead in 2 worker processes
    python tests/kernel_specs_sm90.py launch           # launch the same ops again

Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from compile_sm90 import compile_only

from evaluation.kernel_specs import Prebuild, read_specs, record
from hf_sparse_kv.ops.triton import paged_write, topk_indices


def launch() -> None:
    """A row top-k (tiles sized by the row) and a paged write, on small CPU tensors (never run)."""
    g = torch.Generator().manual_seed(0)
    topk_indices(torch.randn(2, 2, 300, generator=g), 20, method="row")
    B, H, MB, BS, D = 2, 2, 4, 16, 64
    k_pool, v_pool = (torch.randn(B * MB, H, BS, D, generator=g).to(torch.bfloat16) for _ in range(2))
    meta = [torch.randn(B * MB, H, D, generator=g).to(torch.bfloat16) for _ in range(3)]
    table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
    new = torch.randn(B, H, 3, D, generator=g).to(torch.bfloat16)
    paged_write(k_pool, v_pool, *meta, table, torch.zeros(B, dtype=torch.int32), new, new)


def main() -> int:
    step = sys.argv[1]
    if step == "record":
        with compile_only(), record(sys.argv[2]):
            launch()
    elif step == "prebuild":
        specs = read_specs(sys.argv[2])
        pre = Prebuild(specs, workers=2, target=("cuda", 90, 32))
        ended = pre.wait(300)
        summary = pre.summary()
        print(summary)
        pre.close()
        return 0 if ended and summary.startswith(f"{len(specs)} of {len(specs)} built in ") else 1
    elif step == "launch":
        with compile_only():
            launch()
    else:
        sys.exit(f"unknown step {step!r}")
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("kernel_specs_sm90.py builds kernels: run it without TRITON_INTERPRET")
    sys.exit(main())
