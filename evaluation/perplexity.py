"""Perplexity of the last ``N`` tokens of long windows under a policy's decode semantics, two ways.

- ``decode``: the patched model itself. Prefill ``W - N - 1`` tokens, then feed tokens one at a time as decode steps
  (each runs the policy); the step at position ``t`` scores token ``t + 1``. Exact, slow.
- ``simulate``: :class:`~evaluation.simulate.SimulateSession`, the same steps computed in one forward with
  per-query masks. Fast; tested to agree with ``decode`` on tiny models.

In both ways every one of the ``N`` scored tokens is predicted by a step that ran the policy.
"""

from __future__ import annotations

import math

import torch

from hf_sparse_kv import PagedKVCache, cache_kwarg, patch_model, unpatch_model
from hf_sparse_kv.policies import Policy

from .simulate import SimulateSession


def decode_logprobs(
    model,
    ids: torch.Tensor,
    n_scored: int,
    policy: Policy,
    dense_layers=(0, 1),
    block_size: int = 16,
    mode: str = "block",
) -> torch.Tensor:
    """The ``decode`` way: ``[N, V]`` log-probabilities of the last ``n_scored`` tokens of ``ids [1, W]``."""
    split = ids.shape[1] - n_scored - 1
    patch_model(model, policy=policy, mode=mode, dense_layers=dense_layers, block_size=block_size)
    try:
        cache = PagedKVCache(model.config, block_size=block_size)
        kw = {cache_kwarg(model): cache, "use_cache": True}
        out = []
        with torch.no_grad():
            model(ids[:, :split], **kw, logits_to_keep=1)  # the prefix fills the cache; its logits are not needed
            for i in range(split, ids.shape[1] - 1):
                out.append(torch.log_softmax(model(ids[:, i : i + 1], **kw).logits[0, -1].float(), -1))
    finally:
        unpatch_model(model)
    return torch.stack(out)


def nll_of(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` negative log-likelihood of the last ``N`` tokens of ``ids [1, W]`` given their log-probs ``[N, V]``."""
    targets = ids[0, ids.shape[1] - logprobs.shape[0] :]
    return -logprobs.gather(1, targets.view(-1, 1)).squeeze(1)


def kl_dense_sparse(dense_logprobs: torch.Tensor, sparse_logprobs: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(dense || sparse) of the next-token distributions, in nats."""
    return (dense_logprobs.exp() * (dense_logprobs - sparse_logprobs)).sum(-1).clamp(min=0)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.float().mean()))


__all__ = ["SimulateSession", "decode_logprobs", "kl_dense_sparse", "nll_of", "perplexity"]
