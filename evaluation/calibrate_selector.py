"""``hf-sparse-kv calibrate-selector``: write the calibration a projected selector takes (``calibration=``).

hf-sparse-kv calibrate-selector [--model smollm2] [--text essays] [--tokens 512] [--offset 0]
                                [--method channels|pairs|pca|svd] [--rank R] [--out selector_calibration.pt]
"""

from __future__ import annotations

import argparse

import torch

from hf_sparse_kv.calibrate_selector import calibrate_selector
from hf_sparse_kv.policies.projected import METHODS


def calibrate(model, tok, text: str, tokens: int, method: str, rank: int | None, offset: int = 0) -> dict:
    """The calibration of ``model`` over ``tokens`` tokens of ``text`` from token ``offset`` (keep it apart from the
    tokens an evaluation then scores)."""
    from .text import essay_tokens

    ids = torch.tensor(essay_tokens(tok, tokens, offset, essays=text), device=model.device).view(1, -1)
    return calibrate_selector(model, ids, method, rank)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hf-sparse-kv calibrate-selector", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3-270m', a hub id or a local path")
    p.add_argument("--text", default="essays", help="'essays' or a text file/folder")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--offset", type=int, default=0, help="first token of the text used")
    p.add_argument("--method", choices=METHODS, default="channels")
    p.add_argument("--rank", type=int, help="numbers kept per key (default: head dim / 8)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="selector_calibration.pt")
    args = p.parse_args(argv)
    from .recipes import load_model_from, load_text

    model, tok = load_model_from({"model": args.model}, args.device)
    cal = calibrate(model, tok, load_text(args.text), args.tokens, args.method, args.rank, args.offset)
    torch.save(cal, args.out)
    first = next(iter(cal["proj"].values()))
    print(
        f"{args.out}: {cal['method']} rank {cal['rank']} of head dim {first.shape[1]}, {len(cal['proj'])} layers, "
        f"{cal['tokens']} tokens"
    )
