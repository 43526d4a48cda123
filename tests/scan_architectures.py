"""What ``patch_model`` does with every causal LM of the installed transformers, at a tiny random size: the scan
behind the lists of ``tests/test_architectures.py`` and README's "Loading a model" (not collected by pytest)::

    python tests/scan_architectures.py                      # every *ForCausalLM class, 2 at a time, a table
    python tests/scan_architectures.py DiffLlama JetMoe     # some of them

Each class runs in its own process (a crash or a hang costs that class only): the model is ``test_architectures.build``'s
(``SMALL`` with its head-dim and per-model overrides); the unpatched model's greedy tokens and per-step logits are
taken; then patched Dense must give the same tokens, and its largest logit difference is reported (``~1e-7`` where
the patch computes what the model does); Quest's decode steps must run; unpatching must give the tokens again. A
class ends in one of:

- ``ok``: all of the above;
- ``refused``: ``patch_model`` raised a ``TypeError`` (the model left as it was);
- ``first-forward``: the patched model raised ``NotImplementedError`` at its first forward (unpatching restored it);
- ``WRONG``: patched Dense gave other tokens, or logits further than ``1e-4`` from the unpatched ones, or unpatching
  did not restore the model: a bug to fix or to refuse;
- ``error``: anything else after patching (a bug, or a message to improve);
- ``no tiny config`` / ``unpatched fails``: the tiny config does not build, or the unpatched model cannot generate
  with it (says nothing about the patch).
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def check(name: str) -> str:
    """One class, in this process: its outcome and a detail, as one line ``name<TAB>outcome<TAB>detail``."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import pytest
    import torch
    from test_architectures import SMALL, build

    from hf_sparse_kv import patch_model, unpatch_model
    from hf_sparse_kv.policies import Dense, Quest

    try:
        model = build(name)
    except (Exception, pytest.skip.Exception) as e:  # noqa: BLE001 - any failure of a tiny config is reported
        return f"{name}\tno tiny config\t{type(e).__name__}: {str(e)[:100]}"
    ids = torch.randint(2, SMALL["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        return out.sequences, torch.stack(out.logits)

    try:
        want, logits = run()
    except Exception as e:  # noqa: BLE001
        return f"{name}\tunpatched fails\t{type(e).__name__}: {str(e)[:100]}"
    try:
        patch_model(model, policy=Dense(), block_size=16, backend="reference")
    except TypeError as e:
        return f"{name}\trefused\t{str(e)[:140]}"
    try:
        try:
            tokens, dense_logits = run()
        finally:
            unpatch_model(model)
        diff = float((dense_logits - logits).abs().max())
        patch_model(model, policy=Quest(budget=48, sink=4, window=16), block_size=16, backend="reference")
        try:
            run()
        finally:
            unpatch_model(model)
    except NotImplementedError as e:
        outcome = "first-forward" if torch.equal(run()[0], want) else "WRONG"
        return f"{name}\t{outcome}\t{str(e)[:140]}"
    except Exception as e:  # noqa: BLE001
        return f"{name}\terror\t{type(e).__name__}: {str(e)[:140]}"
    restored = torch.equal(run()[0], want)
    good = torch.equal(tokens, want) and diff <= 1e-4 and restored
    return f"{name}\t{'ok' if good else 'WRONG'}\tDense max |dlogit| {diff:.1e}, restored: {restored}"


def one(name: str) -> str:
    """:func:`check` in a fresh process (5 minutes at most)."""
    try:
        r = subprocess.run(
            [sys.executable, __file__, "--one", name],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=HERE.parent,
        )
    except subprocess.TimeoutExpired:
        return f"{name}\terror\ttimed out"
    lines = [line for line in r.stdout.splitlines() if line.startswith(f"{name}\t")]
    if lines:
        return lines[-1]
    if r.returncode == -9:  # the kernel's out-of-memory killer, most likely (a default config of a huge model)
        return f"{name}\terror\tkilled (signal 9: out of memory?)"
    return f"{name}\terror\texit {r.returncode}: {r.stderr.strip()[-140:]}"


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(check(sys.argv[2]), flush=True)
        return
    import transformers

    names = sys.argv[1:] or sorted(
        {
            n.removesuffix("ForCausalLM")
            for n in dir(transformers)
            if n.endswith("ForCausalLM") and n != "AutoModelForCausalLM"
        }
    )
    with ThreadPoolExecutor(2) as pool:
        rows = [row.split("\t") for row in pool.map(one, names)]
    print(f"transformers {transformers.__version__}: {len(rows)} causal LMs")
    for outcome in ("WRONG", "error", "first-forward", "refused", "ok", "unpatched fails", "no tiny config"):
        mine = [r for r in rows if r[1] == outcome]
        print(f"\n{outcome}: {len(mine)}")
        for r in mine:
            print(f"  {r[0]:24s} {r[2] if outcome != 'ok' else ''}".rstrip())


if __name__ == "__main__":
    main()
