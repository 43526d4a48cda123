"""How much of its budget :class:`~hf_sparse_kv.policies.TopPBlockTopK` reads, beside its fidelity.

The fidelity recipe reports recall and hit rate at a fixed budget; a top-p selector reads a varying share of it.
This script scores one essay window (the simulate way, as ``recipes/smollm2_selectors_fidelity.yaml``) under
TwoStageBlockTopK and TopPBlockTopK at several ``p`` and prints, per policy, the attention recall, the block hit
rate against the oracle at the budget, and the mean share of the budget's blocks actually selected (over scored
queries x sparse layers x KV heads).

    python -m evaluation.top_p_budget [--length 2048] [--budget 0.0625] [--ps 0.99 0.9 0.8] [--windows 1]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from hf_sparse_kv.policies import TopPBlockTopK, TwoStageBlockTopK

from .simulate import SimulateSession


@dataclass
class Counted(TopPBlockTopK):
    """TopPBlockTopK that adds up the blocks it selects and the slots it could have filled."""

    kept: int = 0
    slots: int = 0

    def select(self, state):
        sel = super().select(state)
        if not sel.dense:
            self.kept += int((sel.indices >= 0).sum())
            self.slots += sel.indices.numel()
        return sel


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budget", type=float, default=0.0625)
    p.add_argument("--ps", nargs="+", type=float, default=[0.99, 0.9, 0.8])
    p.add_argument("--candidates", type=float, default=4)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--scored", type=int, default=128)
    p.add_argument("--offset", type=int, default=40000)
    args = p.parse_args(argv)
    from .recipes import load_model_from, load_text
    from .text import essay_tokens

    model, tok = load_model_from({"model": args.model}, "cpu")
    text = load_text("essays")
    kw = {"budget": args.budget, "sink": 4, "window": 32, "candidates": args.candidates}
    rows = []
    for w in range(args.windows):
        ids = essay_tokens(tok, args.length, args.offset + w * args.length, essays=text)
        session = SimulateSession(model, torch.tensor(ids).view(1, -1), args.scored, 16)
        dense_nll = session.nll(session.run(TwoStageBlockTopK(budget=1.0), (0, 1))[0]).mean()
        policies = [("two_stage", TwoStageBlockTopK(**kw))] + [(f"top_p {q}", Counted(**kw, p=q)) for q in args.ps]
        for name, policy in policies:
            lp, fid = session.run(policy, (0, 1), fidelity=True)
            share = policy.kept / policy.slots if isinstance(policy, Counted) else 1.0
            rows.append((w, name, fid.recall, fid.hit_rate, share, float(session.nll(lp).mean() - dense_nll)))
            print(f"window {w} {name:>10}: recall {fid.recall:.3f} hit {fid.hit_rate:.3f} budget used {share:.3f} "
                  f"dNLL {rows[-1][-1]:+.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
