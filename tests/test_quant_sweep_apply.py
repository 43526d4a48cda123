"""benchmarks/check_quant_keys.py --sweep --apply: the point it picks per code width (least whole-scoring time summed
over the shapes, among TF32 points right at every shape) and the ``LSE_DEFAULTS`` literal it writes into a copy of
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
                _row(bits, shape, "loop", 4, 4, (60 if bits == 4 else 120) * k, stages=3, per_sm=2, dot="tf32"),
                _row(bits, shape, "loop", 8, 8, 70 * k, stages=2, per_sm=None, dot="tf32"),
            ]
    rows.append({"bits": 2, "shape": "1x8200", "what": "quest selection", "us": 1.0})  # not a grid point
    return rows


def test_best_points_least_total_time_among_right_tf32_points():
    best = cq.best_points(_rows())
    assert best[4] == {"layout": "loop", "tpp": 4, "num_warps": 4, "stages": 3, "per_sm": 2}
    assert best[2] == {"layout": "loop", "tpp": 8, "num_warps": 8, "stages": 2, "per_sm": 4}  # per_sm None: the default


def test_best_points_needs_every_shape():
    rows = [r for r in _rows() if not (r.get("layout") == "loop" and r["shape"] == "8x2048")]
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


def test_defaults_may_carry_the_loop_knobs(monkeypatch):
    """A loop default's stages / per_sm reach the launch: the partials have per_sm * SMS / rows columns."""
    import torch

    from hf_sparse_kv.ops import reference as R

    monkeypatch.setitem(quant.LSE_DEFAULTS, 4, {"layout": "loop", "tpp": 2, "num_warps": 4, "stages": 1, "per_sm": 1})
    torch.manual_seed(0)
    B, H, G, D, BS, MB = 1, 2, 2, 32, 16, 160  # 80 tiles: per_sm 1 gives 40 programs a row, the default 4 gives 80
    NB = B * MB
    k = torch.randn(NB, H, BS, D)
    kmin, kmax = k.amin(2), k.amax(2)
    codes = torch.zeros(NB, H, BS, D * 4 // 8, dtype=torch.uint8)
    table = torch.arange(NB, dtype=torch.int32).view(B, MB)
    lens = torch.tensor([MB * BS - 5], dtype=torch.int32)
    zero = torch.zeros(B, dtype=torch.int32)
    R.quant_write(codes, k, table, zero.long(), lens.long(), int(lens.max()), 4)
    q = torch.randn(B, H * G, D)
    lse, parts = quant.quant_block_lse_parts(q, codes, kmin, kmax, table, lens, zero, D**-0.5, 4)
    NP, _ = quant.loop_split(B * H, -(-MB // 2), None, quant.SMS)
    assert parts is not None and parts[0].shape == (B, H * G, NP) and NP == 40
    torch.testing.assert_close(lse, R.quant_block_lse(q, codes, kmin, kmax, table, lens, zero, D**-0.5, 4))
