# --- Triton kernels on CPU (hf_sparse_kv.ops.triton tests) -------------------------------------------------------
# Without CUDA the Triton kernels run through Triton's interpreter; TRITON_INTERPRET must be set before triton is
# imported. Triton 3.6's interpreter converts loop bounds with int(<1-element array>), which NumPy >= 2.4 refuses;
# the shim below takes the element instead (interpreter only).
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
