"""benchmarks/check_quant_keys.py --sweep --apply: the point it picks per code width (least whole-scoring time summed
over the shapes, among points right at every shape at a layout's default precision) and the ``LSE_DEFAULTS`` literal it writes into a copy of
``ops/triton/quant.py``. No GPU: the sweep's rows are made up here."""

import ast
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_quant_keys as cq

from hf_sparse_kv.ops.triton import quant


def _row(bits, shape, layout, tpp, warps, us, shared=1.0, inf_ok=True, **extra):
    return {"bits": bits, "shape": shape, "layout": layout, "tpp": tpp, "num_warps": warps, "scores_us": us,
            "shared": shared, "inf_ok": inf_ok, **extra}  # fmt: skip


def _rows():
    rows = []
    for bits in (2, 4):
        for shape, k in (("1x8200", 1.0), ("8x2048", 2.0)):
            rows += [
                _row(bits, shape, "tile", 4, 4, 100 * k),
                # fastest of all but wrong at one shape: never picked
                _row(bits, shape, "wide", 2, 4, 10 * k, shared=0.5 if shape == "8x2048" else 1.0),
                # bf16 products: a timing probe, never a default
                _row(bits, shape, "tile", 4, 4, 5 * k, dot="bf16"),
                _row(bits, shape, "wide", 4, 4, (60 if bits == 4 else 120) * k, dot="tf32"),
                _row(bits, shape, "wide", 8, 8, 70 * k),
                # fp16 products: a probe too; bf16x2 (the diag layout's default precision) may win
                _row(bits, shape, "diag", 4, 4, 4 * k, dot="fp16"),
                _row(bits, shape, "diag", 8, 4, (80 if bits == 4 else 50) * k, dot="bf16x2"),
            ]
    rows.append({"bits": 2, "shape": "1x8200", "what": "quest selection", "us": 1.0})  # not a grid point
    return rows


def test_best_points_least_total_time_among_right_tf32_points():
    best = cq.best_points(_rows())
    assert best[4] == {"layout": "wide", "tpp": 4, "num_warps": 4}
    assert best[2] == {"layout": "diag", "tpp": 8, "num_warps": 4}


def test_best_points_needs_every_shape():
    rows = [
        r for r in _rows() if not (r.get("layout") in ("wide", "diag") and r["tpp"] != 2 and r["shape"] == "8x2048")
    ]
    assert cq.best_points(rows)[4] == {"layout": "tile", "tpp": 4, "num_warps": 4}


def test_apply_defaults_rewrites_the_literal_only(tmp_path):
    path = tmp_path / "quant.py"
    shutil.copy(quant.__file__, path)
    before = path.read_text()
    best = cq.apply_defaults(_rows(), str(path))
    after = path.read_text()
    tree = ast.parse(after)
    literal = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "LSE_DEFAULTS")
    assert ast.literal_eval(literal) == best
    start = before.index("LSE_DEFAULTS = {")
    assert after[:start] == before[:start]  # nothing else changed
    tail = before[before.index("TAIL_TILE = ") :]
    assert after.endswith(tail)


def test_apply_defaults_refuses_without_a_right_point(tmp_path):
    path = tmp_path / "quant.py"
    shutil.copy(quant.__file__, path)
    rows = [{**r, "shared": 0.5} if r.get("bits") == 2 and "layout" in r else r for r in _rows()]
    with pytest.raises(SystemExit):
        cq.apply_defaults(rows, str(path))
    assert path.read_text() == Path(quant.__file__).read_text()
