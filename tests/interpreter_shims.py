"""Two fixes to Triton 3.6's interpreter (the kernels run as Python on a CPU under ``TRITON_INTERPRET=1``), applied by
``tests/conftest.py`` and by the benchmarks' CPU dry runs (``benchmarks/common.py: cpu_dry_run``):

- loop bounds are converted with ``int(<1-element array>)``, which NumPy >= 2.4 refuses: take the element instead;
- ``tl.dot`` multiplies bf16 operands as the uint16 words it stores them in (a product of ~1e10): widen them to
  float32 first (exact).

Both patch the interpreter's classes, once per process; without Triton (or with another layout of its interpreter)
:func:`apply` does nothing.
"""

from __future__ import annotations


def apply() -> None:
    """Patch Triton's interpreter (idempotent)."""
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if getattr(interp, "_hf_sparse_kv_shims", False):
            return
        patch_lang_tensor = interp._patch_lang_tensor
        create_dot = interp.InterpreterBuilder.create_dot
    except (ImportError, AttributeError):
        return

    def _patch_lang_tensor_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _widen_bf16(x):
        if x.dtype != tl.bfloat16:
            return x
        return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision, max_num_imprecise_acc)

    interp._patch_lang_tensor = _patch_lang_tensor_index
    interp.InterpreterBuilder.create_dot = _create_dot_bf16
    interp._hf_sparse_kv_shims = True
