# --- Triton kernels on CPU (hf_sparse_kv.ops.triton tests) -------------------------------------------------------
# Without CUDA the Triton kernels run through Triton's interpreter; TRITON_INTERPRET must be set before triton is
# imported. Triton 3.6's interpreter converts loop bounds with int(<1-element array>), which NumPy >= 2.4 refuses;
# the shim below takes the element instead (interpreter only).
import os

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
