"""``hf-sparse-kv``: the command line.

    hf-sparse-kv demo [options]                        the demo table (evaluation.demo)
    hf-sparse-kv calibrate [--shapes 32,8,128] [--out crossover.json]   measure mode="auto"'s crossover table
    hf-sparse-kv calibrate-selector [--model M] [--method channels|pca] [--out sel.pt]   a projected selector's
                               calibration (evaluation.calibrate_selector)
    hf-sparse-kv run recipes/<name>.yaml [more.yaml]   run recipes (resumes: cells already done are skipped)
    hf-sparse-kv eval <recipe> [--model M] [--lengths 2048 8192] [--budgets 1/8 1/16] [--policies quest ...]
                               [--output DIR] [--set key=value ...]

``eval`` runs a recipe (perplexity, fidelity, needle, qa) from the command line alone, over the defaults of
``recipes/<recipe>`` style configs; ``--config`` starts from a YAML file instead. ``accelerate launch -m
evaluation.cli run ...`` shards the trials over the launched processes.
"""

from __future__ import annotations

import argparse
import sys


def _value(text: str):
    import yaml

    return yaml.safe_load(text)


def run_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hf-sparse-kv run", description="run recipe YAML files (resumable)")
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (YAML value)")
    args = p.parse_args(argv)
    _run_all(args.recipes, dict(_split(s) for s in args.set))


def _split(item: str):
    key, _, value = item.partition("=")
    return key, _value(value)


def _run_all(configs: list, overrides: dict) -> None:
    from .recipes import run_recipe
    from .sweep import load_config

    loaded: dict = {}
    for config in configs:
        cfg = load_config(config, overrides)
        key = (cfg["model"], cfg.get("dtype"), cfg.get("device"))
        model, tok = loaded.get(key, (None, None))
        if model is None:
            from .recipes import load_model_from
            from .sweep import Shard

            model, tok = load_model_from(cfg, cfg.get("device") or Shard.detect(cfg.get("device")).device)
            loaded = {key: (model, tok)}
        rows = run_recipe(cfg, model=model, tokenizer=tok)
        print(f"\n{cfg['recipe']} -> {cfg['output']}")
        _print_rows(rows)


def _print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    keys = [k for k in rows[0] if k not in ("budget_value",)]
    print("  ".join(f"{k:>12}" for k in keys))
    for r in rows:
        print("  ".join(f"{(f'{r[k]:.4g}' if isinstance(r[k], float) else str(r[k])):>12}" for k in keys))


def eval_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hf-sparse-kv eval", description="run one recipe from the command line")
    p.add_argument("recipe", choices=["perplexity", "fidelity", "needle", "qa"])
    p.add_argument("--config", help="start from this YAML file")
    p.add_argument("--model", help="'smollm2', 'gemma3-270m', a hub id or a local path")
    p.add_argument("--text", help="'essays', a text file/folder, or a YAML dict for datasets")
    p.add_argument("--lengths", nargs="+", type=int)
    p.add_argument("--budgets", nargs="+")
    p.add_argument("--policies", nargs="+", help="policy names (dense, quest, sink_window, block_topk, ...)")
    p.add_argument("--dense-layers", nargs="*", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--output")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other key (YAML value)")
    args = p.parse_args(argv)
    cfg = {"recipe": args.recipe}
    if args.config:
        from pathlib import Path

        import yaml

        cfg = {**yaml.safe_load(Path(args.config).read_text()), "recipe": args.recipe}
    given = {
        "model": args.model,
        "lengths": args.lengths,
        "budgets": args.budgets,
        "dense_layers": args.dense_layers,
        "block_size": args.block_size,
        "output": args.output,
        "text": _value(args.text) if args.text else None,
        "policies": [{"name": n} for n in args.policies] if args.policies else None,
    }
    cfg.update({k: v for k, v in given.items() if v is not None})
    cfg.update(dict(_split(s) for s in args.set))
    _run_all([cfg], {})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": None, "calibrate": None, "calibrate-selector": None, "run": run_main, "eval": eval_main}
    if not argv or argv[0] not in commands:
        print(f"usage: hf-sparse-kv {{{','.join(commands)}}} [options]   (add --help after a command)")
        raise SystemExit(2)
    if argv[0] == "demo":
        from . import demo

        demo.main(argv[1:])
        return
    if argv[0] == "calibrate":
        from hf_sparse_kv import calibrate

        calibrate.main(argv[1:])
        return
    if argv[0] == "calibrate-selector":
        from . import calibrate_selector

        calibrate_selector.main(argv[1:])
        return
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
