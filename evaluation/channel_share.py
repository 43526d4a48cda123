"""Issue 13: how much of ``q . k`` the ``r`` channels of the largest ``|q|`` carry, per model (why scoring on a
quarter of the channels works on one model and not on another).

:mod:`evaluation.channel_quant` scores keys on the ``r`` channels where the GQA group's pooled ``|q|`` is largest
(SparQ's choice). On the H200 (evaluation/RESULTS.md, 2026-12-01 17:07-17:32 UTC) ``r = D / 4`` with the blocks'
mean keys for the other channels was the oracle within noise on Qwen2.5 at 32K and 27-33 points of perplexity over
it on Gemma-3. This module measures, on real prefills (post-RoPE queries and keys of every full-attention layer,
the last ``--queries`` positions against all earlier ones, CPU float32):

- ``share``: ``sum_S |q_d k_d| / sum_d |q_d k_d|``, the kept channels' part of the dot product's magnitude;
- ``corr``: the Pearson correlation over keys between the exact logit ``q . k`` and the kept channels' ``q_S . k_S``
  (what a ranking sees), averaged over query heads and positions;
- ``recall``: the share of the exact top ``1/16`` keys of each query head that the kept channels' top ``1/16`` holds.

    python -m evaluation.channel_share --models smollm2 gemma3-270m qwen2.5-coder-1.5b --length 2048 \\
        --out evaluation/results/channel_share_cpu        # --at projection / norm: before RoPE (and QK-norm)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_sparse_kv.calibrate_selector import record_qk

from .channel_quant import channel_mask
from .simulate import full_attention_layers


def channel_share(
    q: torch.Tensor, k: torch.Tensor, channels: int, group: int = 1, queries: int = 64, top: float = 1 / 16
) -> dict[str, float]:
    """``share``, ``corr`` and ``recall`` (module docstring) of one layer.

    Args: ``q [Hq, N, D]`` and ``k [Hkv, N, D]`` (post-RoPE, one sequence); ``channels`` (``r``) and ``group``
    (runs of channels) as :func:`evaluation.channel_quant.channel_mask`; the last ``queries`` positions are scored
    against the ``N - queries`` positions before them; ``top``: the share of those keys ``recall`` compares.
    """
    Hq, N = q.shape[:2]
    Hkv = k.shape[0]
    if not 0 < queries < N:
        raise ValueError(f"queries must be in 1..{N - 1}, not {queries}")
    qs = q[:, N - queries :].float()  # [Hq, Q, D]
    ks = k[:, : N - queries].float().repeat_interleave(Hq // Hkv, 0)  # [Hq, K, D]
    mask = channel_mask(qs.transpose(0, 1), Hkv, channels, group)  # [Q, Hkv, D]
    mask = mask.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)  # [Hq, Q, D]
    kept = torch.einsum("hqd,hkd->hqk", qs.abs() * mask, ks.abs())
    whole = torch.einsum("hqd,hkd->hqk", qs.abs(), ks.abs())
    exact = torch.einsum("hqd,hkd->hqk", qs, ks)
    part = torch.einsum("hqd,hkd->hqk", qs * mask, ks)
    e, p = exact - exact.mean(-1, keepdim=True), part - part.mean(-1, keepdim=True)
    corr = (e * p).sum(-1) / (e.norm(dim=-1) * p.norm(dim=-1)).clamp(min=1e-30)  # [Hq, Q]
    n_top = max(1, round(top * ks.shape[1]))
    want = torch.zeros_like(exact).scatter_(-1, exact.topk(n_top, -1).indices, 1.0)
    got = torch.zeros_like(part).scatter_(-1, part.topk(n_top, -1).indices, 1.0)
    return {
        "share": float((kept.sum(-1) / whole.sum(-1).clamp(min=1e-30)).mean()),
        "corr": float(corr.mean()),
        "recall": float(((want * got).sum(-1) / n_top).mean()),
    }


POINTS = ("attention", "projection", "norm")


def record_at(model, ids: torch.Tensor, at: str = "attention") -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's queries ``[Hq, N, D]`` and keys ``[Hkv, N, D]`` (float32) over the prefill
    ``ids [1, N]``, taken ``at``: ``"attention"`` (what attention sees: after any QK-norm and RoPE),
    ``"projection"`` (the outputs of ``q_proj`` / ``k_proj``: before both) or ``"norm"`` (the outputs of ``q_norm`` /
    ``k_norm``, Gemma-3's and Qwen3's per-head RMSNorm with learned per-channel scales: before RoPE)."""
    if at not in POINTS:
        raise ValueError(f"at must be one of {POINTS}, not {at!r}")
    if at == "attention":
        return record_qk(model, ids)
    names = ("q_proj", "k_proj") if at == "projection" else ("q_norm", "k_norm")
    attn = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "k_proj")]
    if not all(hasattr(m, n) for m in attn for n in names):
        raise ValueError(f"{type(model).__name__}'s attention has no {names[0]} / {names[1]} to record at {at!r}")
    record: dict[int, list] = {m.layer_idx: [None, None] for m in attn}
    handles = []
    for m in attn:
        D = m.head_dim
        for i, n in enumerate(names):

            def hook(_mod, _inp, out, layer=m.layer_idx, i=i, D=D):
                x = out.detach().float()[0]  # projection: [N, H * D]; norm: [H, N, D]
                record[layer][i] = x.view(x.shape[0], -1, D).transpose(0, 1) if at == "projection" else x

            handles.append(getattr(m, n).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {layer: (q, k) for layer, (q, k) in record.items()}


def measure(
    model, ids: torch.Tensor, fractions: list[float], group: int = 1, queries: int = 64, at: str = "attention"
) -> list[dict]:
    """One row per (full-attention layer, fraction of channels ``r / D``) of :func:`channel_share` over the
    prefill ``ids [1, N]``, the queries and keys taken ``at`` (:func:`record_at`)."""
    record = record_at(model, ids, at)
    rows = []
    for layer in sorted(full_attention_layers(model.config)):  # the layers a paged cache (a policy) covers
        q, k = record[layer]
        D = q.shape[-1]
        for f in fractions:
            r = max(group, round(f * D / group) * group)
            rows.append({"layer": layer, "at": at, "channels": r, "of": D, **channel_share(q, k, r, group, queries)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2"])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--at", choices=POINTS, default="attention", help="where queries and keys are taken (record_at)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from .assets import load_model
    from .suite import suite_text

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["model"], r["group"], r.get("at", "attention")) for r in rows}
    for name in args.models:
        if (name, args.group, args.at) in done:  # a rerun adds only what is missing
            continue
        t0 = time.perf_counter()
        model, tok = load_model(name)
        for text in ("essays", "kjv"):
            body = suite_text(text)
            start = len(body) // 2  # one window from the middle of each haystack
            ids = tok.encode(body[start : start + 8 * args.length], add_special_tokens=False)[: args.length]
            for row in measure(model, torch.tensor([ids]), args.fractions, args.group, args.queries, args.at):
                row = {"model": name, "text": text, "length": len(ids), "group": args.group, **row}
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        del model
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    table = [
        "| model | taken at | r / D | share | corr | recall of the top 1/16 | layers × windows |",
        "| --- " * 7 + "|",
    ]

    def key(x: dict) -> tuple:
        return x["model"], x.get("at", "attention"), x["channels"], x["of"], x["group"]

    for model, at, r, D, g in sorted({key(x) for x in rows}, key=lambda k: (k[0], POINTS.index(k[1]), k[2])):
        mine = [x for x in rows if key(x) == (model, at, r, D, g)]
        mean = {m: sum(x[m] for x in mine) / len(mine) for m in ("share", "corr", "recall")}
        runs = f" (runs of {g})" if g > 1 else ""
        cells = " | ".join(f"{mean[m]:.3f}" for m in ("share", "corr", "recall"))
        table.append(f"| {model} | {at} | {r}/{D}{runs} | {cells} | {len(mine)} |")
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
