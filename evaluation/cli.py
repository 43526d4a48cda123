"""``hf-sparse-kv``: the command line (``hf-sparse-kv --help`` lists the commands).

    hf-sparse-kv demo [options]                        the demo table (evaluation.demo)
    hf-sparse-kv calibrate [--shapes 32,8,128] [--policy Quest --policy-args JSON] [--out crossover.json]
                               measure mode="auto"'s crossover table for a policy (default Quest)
    hf-sparse-kv calibrate-selector [--model M] [--method channels|pca] [--out sel.pt]   a projected selector's
                               calibration (evaluation.calibrate_selector)
    hf-sparse-kv run recipes/<name>.yaml [more.yaml]   run recipes (resumes: cells already done are skipped)
    hf-sparse-kv stage FILE --name NAME | --model M | --extras   split a file into parts for a remote machine
    hf-sparse-kv suite {smollm2,gemma3,qwen2.5} --out DIR [--time-limit S] [--summarize]   a model's whole suite
    hf-sparse-kv eval <recipe> [--model M] [--lengths 2048 8192] [--budgets 1/8 1/16] [--policies quest ...]
                               [--output DIR] [--set key=value ...]

``eval`` runs a recipe (perplexity, fidelity, needle, qa) from the command line alone, over the defaults of
``recipes/<recipe>`` style configs; ``--config`` starts from a YAML file instead. ``accelerate launch -m
evaluation.cli run ...`` shards the trials over the launched processes. Policies are named as in
:data:`hf_sparse_kv.policies.POLICIES` (``quest``, ``sink_window``) or by their class (``Quest``, ``SinkWindow``).

``run`` and ``eval`` check every recipe and flag before loading a model; a mistake is reported in one line on stderr
with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _value(text: str):
    import yaml

    return yaml.safe_load(text)


COMMANDS = {
    "demo": "the demo table: SmolLM2-135M-Instruct, a 4K-token essay with a needle, Dense / Quest / SinkWindow",
    "calibrate": 'measure the crossover table of mode="auto" on this GPU for a policy (--policy, --out crossover.json)',
    "run": "run recipe YAML files (recipes/*.yaml); an interrupted run resumes",
    "eval": "run one recipe (perplexity, fidelity, needle, qa) from flags alone",
    "stage": "split a file into parts for a GPU machine without network (--model M, --extras, or FILE --name N)",
    "suite": "a model's whole quality suite (smollm2, gemma3, qwen2.5), resumable; --summarize writes the tables",
    "calibrate-selector": "calibrate a compressed-key selector (channels, RoPE pairs, PCA or SVD) on a model's text",
}


LAZY = {  # command -> the module whose main() runs it
    "demo": ".demo",
    "stage": ".stage",
    "suite": ".suite_cli",
    "calibrate": "hf_sparse_kv.calibrate",
    "calibrate-selector": ".calibrate_selector",
}


def usage() -> str:
    """The top-level help: the commands, one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(
        ["usage: hf-sparse-kv <command> [options]   (hf-sparse-kv <command> --help: its options)", "", "commands:"]
        + lines
    )


def fail(message: str) -> None:
    """Report a user's mistake in one line on stderr and exit with code 2 (as argparse does)."""
    print(f"hf-sparse-kv: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def run_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="hf-sparse-kv run", description="run recipe YAML files (resumable)")
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (YAML value)")
    args = p.parse_args(argv)
    _run_all(args.recipes, dict(_split(s) for s in args.set))


def _split(item: str):
    key, eq, value = item.partition("=")
    if not eq or not key:
        fail(f"--set takes KEY=VALUE, got {item!r}")
    try:
        return key, _value(value)
    except Exception as e:  # noqa: BLE001 - a YAML error, reported in one line
        fail(f"--set {item!r}: {e}")


def _checked(configs: list, overrides: dict) -> list[dict]:
    """Every config loaded and checked (:func:`evaluation.sweep.check_config`) before any model loads; a mistake
    ends the command with one line on stderr (exit code 2)."""
    from .sweep import check_config, load_config

    checked = []
    for config in configs:
        where = f"{config}: " if isinstance(config, str) else ""
        try:
            checked.append(check_config(load_config(config, overrides)))
        except Exception as e:  # noqa: BLE001 - a missing file, bad YAML, a bad value: all the user's to fix
            fail(f"{where}{e}")
    return checked


def _run_all(configs: list, overrides: dict) -> None:
    from .recipes import run_recipe

    loaded: dict = {}
    for cfg in _checked(configs, overrides):
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
    from hf_sparse_kv.policies import POLICIES

    from .sweep import RECIPES

    p.add_argument("recipe", choices=RECIPES)
    p.add_argument("--config", help="start from this YAML file")
    p.add_argument("--model", help="'smollm2', 'gemma3-270m', a hub id or a local path")
    p.add_argument("--text", help="'essays', a text file/folder, or a YAML dict for datasets")
    p.add_argument("--lengths", nargs="+", type=int)
    p.add_argument("--budgets", nargs="+")
    p.add_argument(
        "--policies",
        nargs="+",
        help=f"policy names: {', '.join(POLICIES)} (or by class: {', '.join(c.__name__ for c in POLICIES.values())})",
    )
    p.add_argument("--dense-layers", nargs="*", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--output")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other key (YAML value)")
    args = p.parse_args(argv)
    cfg = {"recipe": args.recipe}
    if args.config:
        from pathlib import Path

        import yaml

        try:
            cfg = {**yaml.safe_load(Path(args.config).read_text()), "recipe": args.recipe}
        except Exception as e:  # noqa: BLE001 - a missing or unreadable file
            fail(f"--config {args.config}: {e}")
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
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        fail(f"unknown command {argv[0]!r}" if argv else "a command is required")
    if argv[0] in LAZY:  # their modules are imported only when asked for (models, compilers, plotting)
        importlib.import_module(LAZY[argv[0]], __package__).main(argv[1:])
        return
    {"run": run_main, "eval": eval_main}[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
