"""What a results folder records about the run's software and machine (shared by every recipe's summary)."""

from __future__ import annotations

import platform
import time
from typing import Any


def environment() -> dict[str, Any]:
    """Date, machine (CPU architecture, torch threads, CUDA device name when there is one) and package versions."""
    import torch
    import transformers

    import hf_sparse_kv

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, cuda={torch.cuda.is_available()}"
        + (f" ({gpu})" if gpu else ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_sparse_kv": hf_sparse_kv.__version__,
    }
