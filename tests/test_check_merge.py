"""benchmarks/check_merge.py on the CPU at a tiny shape (a dry run of the GPU check): every row written, a merged row
equal to its unmerged twin in float32, the exit status 0; the same script fails (status 1) when a float32 merged row
differs by more than its tolerance."""

import csv
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_merge

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(monkeypatch, tmp_path):
    out = tmp_path / "m.csv"
    argv = ["check_merge.py", "--device", "cpu", "--tiny", "--layers", "2", "--context", "48", "--steps", "3", "--out",
            str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        check_merge.main()
    with open(out) as f:
        return exit_.value.code, {r["row"]: r for r in csv.DictReader(f)}


def test_dry_run_checks_every_merged_row(monkeypatch, tmp_path):
    code, rows = _run(monkeypatch, tmp_path)
    assert code == 0
    names = ["unpatched", "graph+compile: Dense", "graph+compile+merged: Dense", "graph+compile: Quest 1/16",
             "graph+compile+merged: Quest 1/16"]  # fmt: skip
    assert list(rows) == [f"{d}: {n}" for d in ("float32", "bfloat16") for n in names]
    for name in ("graph+compile+merged: Dense", "graph+compile+merged: Quest 1/16"):
        assert (
            float(rows[f"float32: {name}"]["vs_unmerged"]) < 1e-4 and rows[f"float32: {name}"]["same_argmax"] == "True"
        )
        assert rows[f"bfloat16: {name}"]["nan"] == "False"
    assert float(rows["float32: graph+compile: Dense"]["vs_fp32"]) < 1e-4
    assert 0 < float(rows["bfloat16: graph+compile: Dense"]["vs_fp32"]) < 5e-2  # bf16 against float32


def test_a_merged_row_that_differs_fails_the_check(monkeypatch, tmp_path):
    decode = check_merge.decode
    calls = []

    def skewed(model, ids, steps, cache=None, times=None):
        calls.append(cache)
        logits = decode(model, ids, steps, cache, times)
        return logits * (1 + 1e-3) if len(calls) == 4 else logits  # the 4th decode: float32's merged Dense row

    monkeypatch.setattr(check_merge, "decode", skewed)
    code, rows = _run(monkeypatch, tmp_path)
    assert code == 1 and float(rows["float32: graph+compile+merged: Dense"]["vs_unmerged"]) > 1e-4


@pytest.mark.slow
@pytest.mark.network
def test_real_model_rows_load_each_dtype(monkeypatch, tmp_path, smollm2_fp32):
    """``--model``: ``B`` consecutive windows of the essays, each step the text's next token; with bf16 first, the
    float32 rows after it run the float32 reference model again (a GGUF model refuses ``.to(dtype)``: bf16 is loaded
    once more), so they match the float32 reference; every merged row has its twin's argmax. The float32 load is the
    session's SmolLM2 (conftest), which the check leaves unpatched."""
    from evaluation.text import essay_tokens
    from hf_sparse_kv import is_patched

    loaded, inputs = [], []
    real_model, real_inputs = check_merge.real_model, check_merge.real_inputs

    def load(name, dtype, device):
        shared = name == "smollm2" and dtype == torch.float32 and device == "cpu"
        loaded.append(smollm2_fp32 if shared else real_model(name, dtype, device))
        return loaded[-1]

    monkeypatch.setattr(check_merge, "real_model", load)
    monkeypatch.setattr(check_merge, "real_inputs", lambda *a: inputs.append(real_inputs(*a)) or inputs[-1])
    out = tmp_path / "real.csv"
    argv = ["check_merge.py", "--device", "cpu", "--model", "smollm2", "--batch", "2", "--context", "24", "--steps", "2",
            "--dtypes", "bfloat16,float32", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        check_merge.main()
    with open(out) as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert exit_.value.code == 0 and len(rows) == 10
    assert [next(m.parameters()).dtype for m, _ in loaded] == [torch.float32, torch.bfloat16]
    _, ids, steps = inputs[0]
    text = essay_tokens(loaded[0][1], 52)
    assert ids.tolist() == [text[:24], text[26:50]] and steps.tolist() == [text[24:26], text[50:52]]
    assert float(rows["float32: unpatched"]["vs_fp32"]) == 0.0 < float(rows["bfloat16: unpatched"]["vs_fp32"])
    assert float(rows["float32: graph+compile+merged: Dense"]["vs_unmerged"]) < 1e-4
    assert all(r["same_argmax"] == "True" for name, r in rows.items() if "merged" in name)
    assert all(float(r["ms_step"]) > 0 for name, r in rows.items() if "graph" in name)
    assert not is_patched(smollm2_fp32[0])
