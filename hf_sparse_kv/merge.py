"""Merged projections: sibling ``nn.Linear`` layers that their module feeds the same input, run as one matmul.

A decode step is a matrix-vector product per weight; at batch 1-8 each is bound by the bytes of its weight, and a
small one (an 8B model's k/v projections, 8 MB each) reaches ~26 % of the HBM bandwidth on an H200 where the merged
q/k/v reaches ~77 % (benchmarks/RESULTS.md, ``bench_projections.py``). Merging reads the same bytes in fewer, larger
matmuls. Groups, found by name on any module that holds all of a group's layers: ``q_proj, k_proj, v_proj``
(attention) and ``gate_proj, up_proj`` (MLP).

How, without changing what the model computes or how its weights are named:

- the group's weights (and biases) move into one tensor ``[sum(out), in]``; each layer's ``weight`` stays the same
  ``Parameter`` object, its ``data`` a view of its rows (no memory added: the old storages are freed);
- each layer's ``forward`` is set on the instance: the first layer of the group called with an input computes the
  merged product and keeps it; the others, called with the *same* tensor, return their columns of it (views);
  called with another tensor (or with gradients wanted, or given another ``Parameter`` since), a layer computes its
  own ``F.linear`` as before; a group whose ``data`` was replaced (``model.to(...)`` after patching) is merged again
  from the current weights by :func:`refresh`, which the patch runs before every forward of more than one token;
- :func:`unmerge` gives every layer its own storage back (copies of its rows, the same values) and removes the
  instance ``forward``: the model is as it was, bit for bit.

A group is merged only where that is plainly safe: exact ``nn.Linear`` layers (not quantized or parallel
subclasses), plain tensors of one dtype and device (not DTensor, not ``meta``), no forward hooks of their own or
accelerate's ``_hf_hook``, the same input width, biases on all or none. The rest stay as they are.

Nothing here is module-level state: what a merge keeps lives on its :class:`MergedGroup`, which the patch keeps in
its :class:`~hf_sparse_kv.patched.PatchState`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .ops.library import decode_linear_op
from .ops.reference import DECODE_LINEAR_DTYPES, DECODE_LINEAR_ROWS

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SINGLES = (("o_proj",), ("down_proj",))  # the layers that merge nowhere: groups of one with ``kernel=True``


class MergedGroup:
    """One merged group: its layers, the merged weight ``[sum(out), in]`` (and bias ``[sum(out)]``), each layer's
    columns of the merged output, and the product of the last input (``[..., sum(out)]``) until every layer took
    its part."""

    def __init__(self, layers: list[torch.nn.Linear], kernel: bool = False):
        self.layers = layers
        self.kernel = kernel  # a decode-sized input on CUDA runs hf_sparse_kv's matmul kernel instead of F.linear
        self.sizes = [m.weight.shape[0] for m in layers]  # a layer's own rows (a shard's, not out_features)
        self.last: tuple[torch.Tensor, list[torch.Tensor], list[bool]] | None = None
        self.active = True
        self.remerge()
        for i, m in enumerate(layers):
            m.forward = partial(self.part, i)

    def remerge(self) -> None:
        """The layers' current weights (and biases) into one tensor each, every layer's data a view of its rows."""
        layers = self.layers
        if len(layers) == 1:  # a group of one keeps its layer's own storage
            self.weight, bias = layers[0].weight.detach(), layers[0].bias
            self.bias = None if bias is None else bias.detach()
            self.params, self.ptrs, self.last = [(layers[0].weight, bias)], [_data_ptrs(layers[0])], None
            return
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in layers])
            self.bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
        start = 0
        for m, n in zip(layers, self.sizes):
            m.weight.data = self.weight[start : start + n]
            if self.bias is not None:
                m.bias.data = self.bias[start : start + n]
            start += n
        self.params = [(m.weight, m.bias) for m in layers]  # a layer given another Parameter computes its own
        self.ptrs = [_data_ptrs(m) for m in layers]
        self.last = None

    def _holds(self, index: int) -> bool:
        """Whether layer ``index`` still holds the ``Parameter``s it was merged with."""
        m, (weight, bias) = self.layers[index], self.params[index]
        return m.weight is weight and m.bias is bias

    def intact(self) -> bool:
        """Whether every layer still holds its own ``Parameter``s, views of the merged tensors (re-patching keeps
        such a group; any other is merged afresh)."""
        return self.active and all(
            self._holds(i) and _data_ptrs(m) == ptrs for i, (m, ptrs) in enumerate(zip(self.layers, self.ptrs))
        )

    def stale(self) -> bool:
        """Whether a layer holds its ``Parameter``s but their ``data`` was replaced (``param.data = ...``): the
        merged product would not see it. (A layer given another ``Parameter`` computes its own product.)"""
        return self.active and any(
            self._holds(i) and _data_ptrs(m) != ptrs for i, (m, ptrs) in enumerate(zip(self.layers, self.ptrs))
        )

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s output for ``x [..., in]``: its columns of the merged product ``[..., out]``."""
        layer = self.layers[index]
        if not self._holds(index) or (torch.is_grad_enabled() and (layer.weight.requires_grad or x.requires_grad)):
            return F.linear(x, layer.weight, layer.bias)  # autograd reaches the parameters through their own views
        if self.last is None or self.last[0] is not x or self.last[2][index]:
            self.last = (x, list(self.product(x).split(self.sizes, dim=-1)), [False] * len(self.sizes))
        _, outs, taken = self.last
        taken[index] = True
        out = outs[index]
        if all(taken):
            self.last = None  # every layer had its part: keep nothing between forwards
        return out

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` times the merged weight: ``[..., sum(out)]``. With ``kernel``, a decode-sized input (at
        most ``reference.DECODE_LINEAR_ROWS`` rows) goes through the ``decode_linear`` custom op (compiled steps trace
        it): the Triton matmul of :mod:`hf_sparse_kv.ops.triton.linear` on CUDA in ``DECODE_LINEAR_DTYPES`` (bf16 /
        fp16), ``F.linear`` (the reference) elsewhere."""
        if not self.kernel or x.numel() > DECODE_LINEAR_ROWS * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        fast = x.is_cuda and x.dtype in DECODE_LINEAR_DTYPES and x.dtype == self.weight.dtype
        return decode_linear_op(x, self.weight, self.bias, "triton" if fast else "reference")

    def unmerge(self) -> None:
        """Each layer its own storage again (a copy of its rows) and its class's ``forward``."""
        self.active, self.last = False, None
        for m in self.layers:
            m.__dict__.pop("forward", None)
            if len(self.layers) == 1:
                continue  # a group of one never left its own storage
            with torch.no_grad():
                m.weight.data = m.weight.data.clone()
                if m.bias is not None:
                    m.bias.data = m.bias.data.clone()
        self.weight = self.bias = None


def _data_ptrs(m: torch.nn.Linear) -> tuple[int, ...]:
    """Where a layer's weight (and bias) data live."""
    return tuple(t.data_ptr() for t in (m.weight, m.bias) if t is not None)


def _uniform(layers: list) -> bool:
    """Plain tensors (not DTensor, not ``meta``) of one dtype and device in every layer's weight and bias."""
    first = layers[0].weight
    return all(
        type(t.data) is torch.Tensor and not t.is_meta and t.dtype == first.dtype and t.device == first.device
        for m in layers
        for t in (m.weight, m.bias)
        if t is not None
    )


def _mergeable(layers: list) -> bool:
    if not all(type(m) is torch.nn.Linear for m in layers) or not _uniform(layers):
        return False
    first = layers[0].weight
    for m in layers:
        if m.weight.shape[1] != first.shape[1] or (m.bias is None) != (layers[0].bias is None):
            return False
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") or "forward" in m.__dict__:
            return False
    return True


def merge(model: torch.nn.Module, kernel: bool = False) -> list[MergedGroup]:
    """Merge every group of :data:`GROUPS` that ``model``'s modules hold and that is safe to merge (module
    docstring); returns the groups, for :func:`unmerge`. With ``kernel``, every group (and each of :data:`SINGLES`,
    as a group of one) computes decode-sized products with the matmul kernel (:meth:`MergedGroup.product`). On an
    error, what was merged is unmerged again."""
    groups: list[MergedGroup] = []
    try:
        for module in model.modules():
            for names in GROUPS + (SINGLES if kernel else ()):
                layers = [getattr(module, n, None) for n in names]
                if all(isinstance(m, torch.nn.Module) for m in layers) and _mergeable(layers):
                    groups.append(MergedGroup(layers, kernel))
    except BaseException:
        unmerge(groups)
        raise
    return groups


def refresh(groups: list[MergedGroup]) -> None:
    """Merge again every group whose layers' ``data`` was replaced since (``model.to(...)`` or ``.half()`` after
    patching, ``param.data = ...``), so that the merged product is the layers' current weights (a group whose layers
    now differ in dtype or device is unmerged instead). The patch runs it before every forward of more than one token
    (a prefill)."""
    for group in groups:
        if not group.stale():
            continue
        if _uniform(group.layers):
            group.remerge()
        else:  # its layers now differ in dtype or device: each computes its own product from now on
            group.unmerge()


def unmerge(groups: list[MergedGroup]) -> None:
    """Undo :func:`merge`: every layer as it was (its own storage, the same values, its class's ``forward``)."""
    for group in groups:
        group.unmerge()
