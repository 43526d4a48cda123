"""``hf-sparse-kv``: the command line. ``hf-sparse-kv demo [options]`` runs :mod:`evaluation.demo`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "evaluation.demo"}
    if not argv or argv[0] not in commands:
        print(f"usage: hf-sparse-kv {{{','.join(commands)}}} [options]   (add --help after a command)")
        raise SystemExit(2)
    from importlib import import_module

    import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
