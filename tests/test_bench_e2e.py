"""benchmarks/bench_e2e.py runs on the CPU at a tiny shape (a dry run of the GPU command): the floor rows, the
generate() rows with the left-padded batch against the unpadded one, the timestamped progress and the CSV written
row by row. No speed is checked here (a benchmark measures speed, a test that it runs)."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e

ROWS = (
    "floor: dense,unpatched sdpa,graph: Quest 1/16 block,generate: floor: dense,generate: unpatched sdpa,"
    "generate: graph: Quest 1/16 block"
)


def _run(monkeypatch, tmp_path, *extra) -> None:
    argv = ["bench_e2e.py", "--device", "cpu", "--tiny", "--ttft", "", "--shapes", "2x64", "--generate", "2x64",
            "--new-tokens", "4", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "e2e.csv"), *extra]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_e2e.main()


def test_bench_e2e_dry_run_writes_floors_generate_and_padded_rows(monkeypatch, tmp_path, capsys):
    _run(monkeypatch, tmp_path, "--rows", ROWS)
    out = capsys.readouterr().out
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    generate = ["generate: floor: dense", "generate: unpatched sdpa", "generate: graph: Quest 1/16 block"]
    expected = ["floor: dense", "unpatched sdpa", "graph: Quest 1/16 block", *generate]
    expected += [f"{name} (left-padded)" for name in generate]
    assert list(rows) == expected  # cheap rows first, in this order; nothing not asked for
    for name in ("unpatched sdpa", "graph: Quest 1/16 block", "generate: graph: Quest 1/16 block"):
        assert float(rows[name]["of_floor"]) > 0 and float(rows[name]["floor_ms"]) > 0
    padded = rows["generate: graph: Quest 1/16 block (left-padded)"]
    ratio = float(padded["ms_per_token"]) / float(rows["generate: graph: Quest 1/16 block"]["ms_per_token"])
    assert float(padded["vs_unpadded"]) == pytest.approx(ratio)
    assert padded["captured_steps"] == "0" and padded["graphs"] == "0"  # counted (no CUDA graph on the CPU)
    # the padded batch holds fewer real tokens: its floor reads less K/V than the unpadded batch's
    floors = [float(rows[f"generate: floor: dense{s}"]["kv_mb_per_step"]) for s in ("", " (left-padded)")]
    assert floors[1] < floors[0]
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert any("generate: graph: Quest 1/16 block (left-padded)" in line for line in progress)
    assert all(line[1:9].count(":") == 2 and " s] " in line for line in progress)  # [HH:MM:SS +elapsed s]


def test_bench_e2e_times_the_prefill_fit_row(monkeypatch, tmp_path):
    """The product-quantized row fits its centres at the prefill of each ``generate()`` (TTFT holds the fit) and
    decodes with them, unpadded and left-padded."""
    row = "generate: graph: pq prefill-fit c4 1/16 block"
    _run(monkeypatch, tmp_path, "--shapes", "", "--rows", row)
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == [row, f"{row} (left-padded)"]
    assert all(float(r["ttft_s"]) > 0 and float(r["ms_per_token"]) > 0 for r in rows.values())


def test_bench_e2e_times_snapkvs_generate_row_through_its_static_steps(monkeypatch, tmp_path):
    """The row of SnapKV 1/4 + Quest 1/16 under ``cuda_graph=True`` runs (on the CPU every step is eager: a CPU
    model is not captured; its static steps are tests/test_graphs.py's), unpadded and left-padded, and reads less
    K/V a step than Quest 1/16 over the whole prompt."""
    row = "generate: graph: SnapKV 1/4 + Quest 1/16 block"
    _run(
        monkeypatch,
        tmp_path,
        "--shapes",
        "",
        "--generate",
        "2x256",
        "--rows",
        f"{row},generate: graph: Quest 1/16 block",
    )
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert set(rows) == {
        f"{name}{s}" for name in (row, "generate: graph: Quest 1/16 block") for s in ("", " (left-padded)")
    }
    assert all(float(r["ms_per_token"]) > 0 and float(r["of_floor"]) > 0 for r in rows.values())
    assert float(rows[row]["kv_mb_per_step"]) < float(rows["generate: graph: Quest 1/16 block"]["kv_mb_per_step"])


def test_bench_e2e_times_the_prefill_of_each_ttft_row(monkeypatch, tmp_path):
    """``--ttft``: the unpatched prefill, then Quest's and the product-quantized selector's (whose prefill fits its
    centres), each a row of its own with its ratio to the unpatched one; ``--rows`` picks either."""
    codes = bench_e2e.PQ_PREFILL._coarse.codes
    fitted = []  # the layers whose centres the timed prefills fit (each prefill fits its cache's own)
    fit = codes.fit
    monkeypatch.setattr(codes, "fit", lambda layer, *a, **kw: fitted.append(layer) or fit(layer, *a, **kw))
    _run(
        monkeypatch, tmp_path, "--ttft", "1x48", "--shapes", "", "--generate", "", "--rows", "TTFT,TTFT: pq prefill-fit"
    )
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["TTFT (s): unpatched / patched", "TTFT (s): unpatched / pq prefill-fit"]
    assert set(fitted) == set(range(bench_e2e.tiny_config().num_hidden_layers))  # every layer's centres fitted
    for r in rows.values():
        assert float(r["ttft_ratio"]) == pytest.approx(float(r["ttft_patched_s"]) / float(r["ttft_s"]))
    _run(monkeypatch, tmp_path, "--ttft", "1x48", "--shapes", "", "--generate", "", "--rows", "TTFT: pq prefill-fit")
    with open(tmp_path / "e2e.csv") as f:
        assert [r["row"] for r in csv.DictReader(f)] == ["TTFT (s): unpatched / pq prefill-fit"]


def test_bench_e2e_refuses_an_unknown_row(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        _run(monkeypatch, tmp_path, "--rows", "graph: Quest 1/16 blocks")


def test_bench_e2e_compiled_generate_rows_run_in_the_compiled_phase(monkeypatch, tmp_path):
    """The ``generate: graph+compile:`` rows compile, so they run in the ``compiled`` phase (last), not with the cheap
    ``generate`` rows; unpadded and left-padded; ``--no-static`` skips transformers' StaticCache rows, not these."""
    row = "generate: graph+compile: Quest 1/16 block"
    _run(monkeypatch, tmp_path, "--shapes", "", "--rows", row, "--phases", "decode,generate")
    assert not (tmp_path / "e2e.csv").exists()  # no row ran (the CSV is written row by row)
    _run(monkeypatch, tmp_path, "--shapes", "", "--rows", row, "--phases", "compiled", "--no-static")  # not a peer row
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == [row, f"{row} (left-padded)"]
    assert float(rows[row]["ms_per_token"]) > 0


def test_bench_e2e_merged_rows_run_compiled(monkeypatch, tmp_path):
    """The ``graph+compile+merged:`` rows (filled-cache steps and generate()) patch with ``merge_projections=True``
    and run (``aot_eager`` on the CPU)."""
    calls = []
    patch_model = bench_e2e.patch_model
    monkeypatch.setattr(bench_e2e, "patch_model", lambda *a, **kw: calls.append(kw) or patch_model(*a, **kw))
    row = "graph+compile+merged: Quest 1/16 block"
    autotune = "graph+compile+merged+autotune: Quest 1/16 block"
    generate = "generate: graph+compile+merged: Quest 1/16 block"
    _run(monkeypatch, tmp_path, "--rows", f"graph+compile: Quest 1/16 block,{row},{autotune},{generate}", "--phases",
         "compiled", "--no-static")  # fmt: skip
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["graph+compile: Quest 1/16 block", row, autotune, generate, f"{generate} (left-padded)"]
    assert all(float(rows[name]["ms_per_token"]) > 0 for name in (row, autotune, generate))
    assert [kw["merge_projections"] for kw in calls] == [False, True, True, True, True]


def test_step_compile_names_each_rows_compile():
    """Each compiled row's ``compile=``: the backend name, inductor's max-autotune for the autotune rows on CUDA
    (``aot_eager`` for every compiled row on the CPU), nothing for rows that do not compile."""
    assert bench_e2e.step_compile("cuda", None) is None and bench_e2e.step_compile("cuda", "reduce-overhead") is None
    assert bench_e2e.step_compile("cuda", "graph") == bench_e2e.step_compile("cuda", "graph+merged") == "inductor"
    assert bench_e2e.step_compile("cuda", "graph+merged+autotune") == {
        "backend": "inductor",
        "mode": "max-autotune-no-cudagraphs",
    }
    assert {bench_e2e.step_compile("cpu", h) for h in ("graph", "graph+merged", "graph+merged+autotune")} == {
        "aot_eager"
    }
    opts = {h: bench_e2e.step_options("cpu", h) for h in (None, "graph", "graph+merged", "graph+merged+linear")}
    assert opts[None] == {"compile": None, "merge_projections": False}
    assert opts["graph"] == {"compile": "aot_eager", "merge_projections": False}
    assert opts["graph+merged"] == {"compile": "aot_eager", "merge_projections": True}
    assert opts["graph+merged+linear"] == {"compile": "aot_eager", "merge_projections": True, "decode_linear": True}


@pytest.mark.parametrize("shape", ["smollm2", "qwen2.5"])
def test_bench_e2e_builds_the_suite_models_shapes(monkeypatch, tmp_path, capsys, shape):
    """``--shape``: a suite model's shape (``benchmarks/shapes.py``: its config, random weights; here 3 of its
    layers) instead of the 8B one; its floor counts its own K/V (head dim and KV heads of that config), its one
    sparse layer (the first two stay dense) reads less, and the table names the shape."""
    argv = ["bench_e2e.py", "--device", "cpu", "--shape", shape, "--layers", "3", "--ttft", "", "--shapes", "1x512",
            "--generate", "", "--steps", "2", "--warmup", "1", "--rows", "floor: dense,graph: Quest 1/16 block",
            "--out", str(tmp_path / "e2e.csv")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_e2e.main()
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    cfg = bench_e2e.model_config(shape, 3)
    kv = 2 * 3 * cfg.num_key_value_heads * bench_e2e.head_dim(cfg) * 2 * 512  # K and V, 3 layers, bf16, 512 tokens
    assert float(rows["floor: dense"]["kv_mb_per_step"]) == pytest.approx(kv / 1e6)
    assert float(rows["graph: Quest 1/16 block"]["ms_per_token"]) > 0
    assert float(rows["graph: Quest 1/16 block"]["kv_mb_per_step"]) < kv / 1e6  # its third layer reads a selection
    assert f"{shape} shape, 3 layers" in capsys.readouterr().out


def test_bench_e2e_refuses_a_shape_it_cannot_floor(monkeypatch, tmp_path):
    """Gemma-3's sliding-window layers hold a window, not the context: the floors would be wrong, so it is refused."""
    with pytest.raises(SystemExit, match="--shape"):
        _run(monkeypatch, tmp_path, "--shape", "gemma3")


def test_fill_caches_without_the_dense_cache_fills_the_same_pages(monkeypatch, tmp_path):
    """``dense=False`` builds no DynamicCache (the 8B shape's 8 × 32K then fits an H100: two 34 GB caches did not)
    and fills the paged cache with the same tokens; the decode phase asks for the dense one only with the unpatched
    row, the compiled phase never (its patched rows read the paged cache alone)."""
    import torch

    model = bench_e2e.build_model(2, "cpu", bench_e2e.tiny_config())
    dense, paged = bench_e2e.fill_caches(model, 2, 40, 8, "cpu")
    none, alone = bench_e2e.fill_caches(model, 2, 40, 8, "cpu", dense=False)
    assert dense is not None and none is None
    for a, b in zip(paged.layers, alone.layers):
        assert torch.equal(a.k_pool, b.k_pool) and torch.equal(a.v_pool, b.v_pool)
    asked = []
    fill = bench_e2e.fill_caches
    monkeypatch.setattr(bench_e2e, "fill_caches", lambda *a, **k: asked.append(k.get("dense", True)) or fill(*a, **k))
    _run(monkeypatch, tmp_path, "--rows", "graph: Quest 1/16 block", "--generate", "")
    _run(monkeypatch, tmp_path, "--rows", "unpatched sdpa", "--generate", "")
    _run(monkeypatch, tmp_path, "--rows", "graph+compile: Quest 1/16 block", "--generate", "", "--phases", "compiled",
         "--no-static")  # fmt: skip
    assert asked == [False, True, False]


def test_bench_e2e_reverse_runs_each_phases_rows_the_other_way_round(monkeypatch, tmp_path):
    """``--reverse``: the filled-cache rows of the decode and the compiled phase are timed in the reverse of the
    tables' order (the CSV is written as they are measured), the floor row first either way."""
    rows = "floor: dense,graph: patched Dense,graph: Quest 1/16 block,graph+compile: patched Dense,graph+compile: Quest 1/16 block"
    order = {}
    for reverse in (False, True):
        extra = ("--reverse",) if reverse else ()
        _run(
            monkeypatch,
            tmp_path,
            "--rows",
            rows,
            "--generate",
            "",
            "--phases",
            "decode,compiled",
            "--no-static",
            *extra,
        )
        with open(tmp_path / "e2e.csv") as f:
            order[reverse] = [r["row"] for r in csv.DictReader(f)]
    assert order[False] == rows.split(",")
    assert order[True] == ["floor: dense", "graph: Quest 1/16 block", "graph: patched Dense",
                           "graph+compile: Quest 1/16 block", "graph+compile: patched Dense"]  # fmt: skip


def test_bench_e2e_times_the_fp8_selector_row(monkeypatch, tmp_path):
    """The float8-key selector's compiled row patches ``Fp8BlockTopK`` (its state refreshed inside the compiled
    step) and writes a time."""
    row = "graph+compile+merged+linear: Fp8 1/16 block"
    _run(monkeypatch, tmp_path, "--rows", row, "--phases", "compiled", "--no-static")
    with open(tmp_path / "e2e.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == [row] and float(rows[row]["ms_per_token"]) > 0
