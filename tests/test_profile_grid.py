"""benchmarks/profile_grid.py on the CPU: a tiny random model of Qwen2's layout through the grid's every cell."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_grid
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_cell_gets_a_perplexity_row_and_a_needle_row(tmp_path, capsys):
    """The issue-12 grid (22 cells): one simulate row per cell after the prefill, one phase row per batch and one
    row per cell of its own seconds; SnapKV's cells run without fidelity (the simulate way refuses it), the others
    with; the CSV holds them all; the cell asked for is profiled."""
    out = tmp_path / "p.csv"
    args = ["--shape", "tiny", "--length", "256", "--batch", "2", "--batches", "2", "--device", "cpu"]
    args += ["--profile", "quest@1/16"]  # one more run of that cell under the profiler
    rows = profile_grid.main(args + ["--dtype", "float32", "--out", str(out)])
    ppl = [r for r in rows if r["part"] == "perplexity"]
    assert [r["cell"] for r in ppl][:2] == ["prefill", "dense@-"] and ppl[-1]["cell"] == "peak"
    cells = {r["cell"]: r for r in ppl[1:-1]}
    assert len(cells) == 22 and all(float(r["seconds"]) > 0 for r in cells.values())
    assert not cells["snapkv@1/16"]["fidelity"] and cells["quest@1/16"]["fidelity"] and not cells["dense@-"]["fidelity"]
    needle = [r for r in rows if r["part"] == "needle"]
    batches = [r for r in needle if r["cell"].startswith("batch ")]
    assert [r["cell"] for r in batches] == ["batch 0", "batch 1"]
    assert all(float(r[k]) > 0 for r in batches for k in ("prefill", "copy", "decode"))
    own = {r["cell"]: r for r in needle if "first" in r}
    assert set(own) == set(cells) and all(float(r["last"]) > 0 for r in own.values())
    assert out.read_text().count("\n") == len(rows) + 1
    assert "profile of quest@1/16, by self host time" in capsys.readouterr().out


def test_windows_scored_together_give_a_row_per_cell_and_refuse_none(monkeypatch):
    """``--windows 2``: the perplexity part scores two windows through one session (``run_windows`` on ``[2, L]``
    ids), a row per cell; ``--windows 0`` is refused."""
    sizes = []
    real = profile_grid.SimulateSession
    monkeypatch.setattr(
        profile_grid, "SimulateSession", lambda m, ids, *a: sizes.append(ids.shape[0]) or real(m, ids, *a)
    )
    args = ["--shape", "tiny", "--length", "128", "--batches", "0", "--device", "cpu", "--dtype", "float32"]
    rows = profile_grid.main(args + ["--windows", "2"])
    assert sizes == [2] and len([r for r in rows if r["part"] == "perplexity"]) == 22 + 2
    with pytest.raises(SystemExit, match="windows"):
        profile_grid.main(args + ["--windows", "0"])


def test_profiled_prints_host_tables_only_when_on(capsys):
    """The profiled batch's tables (host time on the CPU: no device table there); off: nothing printed."""
    import torch

    with profile_grid.profiled("cpu", False, "needle batch"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert capsys.readouterr().out == ""
    with profile_grid.profiled("cpu", True, "needle batch"):
        torch.ones(64, 64) @ torch.ones(64, 64)
    out = capsys.readouterr().out
    assert "by self host time" in out and "aten::mm" in out and "by device time" not in out


def test_needle_batches_prefilled_by_rows(monkeypatch):
    """``--prefill rows``: the needle batches' caches stacked from one prefill per prompt (each batch's prompts go
    through ``stacked_prefill``), a row per batch and cell as with the batch prefill."""
    from evaluation import needle

    stacked = []
    real = needle.stacked_prefill
    monkeypatch.setattr(
        needle, "stacked_prefill", lambda m, prompts, *a: stacked.append(len(prompts)) or real(m, prompts, *a)
    )
    args = ["--shape", "tiny", "--length", "128", "--batch", "2", "--batches", "2", "--device", "cpu"]
    rows = profile_grid.main(args + ["--dtype", "float32", "--no-perplexity", "--prefill", "rows"])
    assert stacked == [2, 2] and len([r for r in rows if r["cell"].startswith("batch ")]) == 2


@pytest.mark.parametrize("whole", [False, True])
def test_whole_refills_refill_the_kept_slot_whole_at_every_turn(monkeypatch, whole):
    """``--whole-refills`` (``DecodeSlots(whole_refills=True)``): every turn on the kept slot refills it whole; by
    default the turns after a batch's first from the same prefill refill only what changed."""
    from hf_sparse_kv.cache import PagedLayer

    kinds = []
    real = PagedLayer.load

    def recording(self, source, length, dst, src, zero=None):
        kinds.append(zero is None)
        return real(self, source, length, dst, src, zero)

    monkeypatch.setattr(PagedLayer, "load", recording)
    args = ["--shape", "tiny", "--length", "128", "--batch", "2", "--batches", "1", "--device", "cpu"]
    profile_grid.main(args + ["--dtype", "float32", "--no-perplexity"] + (["--whole-refills"] if whole else []))
    assert kinds and all(kinds) == whole and any(kinds)
