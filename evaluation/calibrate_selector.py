"""``hf-sparse-kv calibrate-selector``: write the calibration a projected selector takes (``calibration=``).

hf-sparse-kv calibrate-selector [--model smollm2] [--text essays] [--tokens 512] [--offset 0]
                                [--method channels|pairs|pca|svd|pq] [--rank R] [--sub-dim 8] [--centroids 256]
                                [--out selector_calibration.pt]

``--method pq`` writes the centres of a two-stage policy's ``coarse="pq"``: give it ``--tokens`` as many as the
contexts it will serve (the keys' RoPE angles must be covered: hf_sparse_kv.policies.product).
"""

from __future__ import annotations

import argparse

import torch

from hf_sparse_kv.calibrate_selector import calibrate_selector
from hf_sparse_kv.policies.product import METHOD as PQ_METHOD
from hf_sparse_kv.policies.projected import METHODS


def calibrate(model, tok, text: str, tokens: int, method: str, rank: int | None, offset: int = 0, **pq: int) -> dict:
    """The calibration of ``model`` over ``tokens`` tokens of ``text`` from token ``offset`` (keep it apart from the
    tokens an evaluation then scores); ``pq``: ``sub_dim`` / ``centroids`` for ``method="pq"``."""
    from .text import essay_tokens

    ids = torch.tensor(essay_tokens(tok, tokens, offset, essays=text), device=model.device).view(1, -1)
    return calibrate_selector(model, ids, method, rank, **pq)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hf-sparse-kv calibrate-selector", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3-270m', a hub id or a local path")
    p.add_argument("--text", default="essays", help="'essays' or a text file/folder")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--offset", type=int, default=0, help="first token of the text used")
    p.add_argument("--method", choices=(*METHODS, PQ_METHOD), default="channels")
    p.add_argument("--rank", type=int, help="numbers kept per key (default: head dim / 8)")
    p.add_argument("--sub-dim", type=int, default=8, help="pq: channels a piece")
    p.add_argument("--centroids", type=int, default=256, help="pq: centres a piece (at most 256)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="selector_calibration.pt")
    args = p.parse_args(argv)
    from .recipes import load_model_from, load_text

    model, tok = load_model_from({"model": args.model}, args.device)
    pq = {"sub_dim": args.sub_dim, "centroids": args.centroids} if args.method == PQ_METHOD else {}
    cal = calibrate(model, tok, load_text(args.text), args.tokens, args.method, args.rank, args.offset, **pq)
    torch.save(cal, args.out)
    if args.method == PQ_METHOD:
        first = next(iter(cal["centres"].values()))
        print(
            f"{args.out}: pq, {first.shape[1]} pieces of {cal['sub_dim']} channels, {cal['centroids']} centres each, "
            f"{len(cal['centres'])} layers, {cal['tokens']} tokens"
        )
        return
    first = next(iter(cal["proj"].values()))
    print(
        f"{args.out}: {cal['method']} rank {cal['rank']} of head dim {first.shape[1]}, {len(cal['proj'])} layers, "
        f"{cal['tokens']} tokens"
    )
