"""Four fixes to Triton 3.6's interpreter (the kernels run as Python on a CPU under ``TRITON_INTERPRET=1``), applied by
``tests/conftest.py`` and by the benchmarks' CPU dry runs (``benchmarks/common.py: cpu_dry_run``):

- loop bounds are converted with ``int(<1-element array>)``, which NumPy >= 2.4 refuses: take the element instead;
- ``tl.dot`` multiplies bf16 operands as the uint16 words it stores them in (a product of ~1e10): widen them to
  float32 first (exact);
- casts into bf16 truncate float32's mantissa (259.0 became 258, the GPU's round-to-nearest-even gives 260), and
  casts between bf16 and any type but float32 (integers, fp16, float64) convert the value into or out of those
  uint16 words as if they were integers (``.to(tl.bfloat16)`` of the int32 3 gave the bf16 whose bits are 3): go
  through float32 (bf16 to float32 is exact), then round to nearest even, NaN kept NaN;
- casts into float8 e4m3 (``tl.float8e4nv``) drop the carry of a mantissa that rounds up into the next binade (7.89
  became 4.0, the GPU gives 8.0) and truncate subnormals: take torch's conversion (round to nearest even, saturating
  at 448, as the GPU's ``cvt.rn.satfinite``).

All four patch the interpreter's classes, once per process; without Triton (or with another layout of its interpreter)
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
        cast_impl = interp.InterpreterBuilder.cast_impl
        fp_to_fp = interp.InterpreterBuilder.create_fp_to_fp
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

    def _cast_via_float32(self, src, dst_type):
        kinds = (src.dtype.scalar, dst_type.scalar)
        if tl.bfloat16 not in kinds or kinds[0] == kinds[1]:
            return cast_impl(self, src, dst_type)
        f32 = src if kinds[0] == tl.float32 else cast_impl(self, src, tl.float32)  # exact from bf16, by value else
        if kinds[1] != tl.bfloat16:
            return cast_impl(self, f32, dst_type)
        x = np.ascontiguousarray(f32.data, dtype=np.float32)
        bits = x.view(np.uint32).astype(np.uint64)
        words = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest, ties to even
        words = np.where(np.isnan(x), np.uint16(0x7FC0), words)
        return interp.TensorHandle(words, tl.bfloat16)

    def _to_e4m3(src):
        import torch

        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        return interp.TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)

    def _into_e4m3(src, dst_type) -> bool:
        return dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16, tl.bfloat16)

    def _cast(self, src, dst_type):
        if _into_e4m3(src, dst_type):
            return _to_e4m3(_cast_via_float32(self, src, tl.float32))  # by value (a no-op from float32)
        return _cast_via_float32(self, src, dst_type)

    def _fp_to_fp(self, src, dst_type, rounding_mode):
        if _into_e4m3(src, dst_type):
            return _cast(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interp._patch_lang_tensor = _patch_lang_tensor_index
    interp.InterpreterBuilder.create_dot = _create_dot_bf16
    interp.InterpreterBuilder.cast_impl = _cast
    interp.InterpreterBuilder.create_fp_to_fp = _fp_to_fp
    interp._hf_sparse_kv_shims = True
