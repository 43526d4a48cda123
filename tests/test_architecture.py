"""The rules of docs/ARCHITECTURE.md that a test can check: who imports whom (no circles, layers point down), who
writes whose attributes, and the forced-position rule stated once in ``ops/layout.py`` (host and device forms
agree, the Triton scoring kernel agrees with them)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from tiny_models import DEVICE

from hf_sparse_kv.ops import get_ops
from hf_sparse_kv.ops import layout as L

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_sparse_kv", "evaluation", "benchmarks")

# docs/ARCHITECTURE.md, "Who may import whom": module -> the package modules it may import (prefix match)
ALLOWED = {
    "hf_sparse_kv.ops": ("hf_sparse_kv.ops",),
    "hf_sparse_kv.runtime": (),
    "hf_sparse_kv.static": (),
    "hf_sparse_kv.cache": ("hf_sparse_kv.ops", "hf_sparse_kv.runtime", "hf_sparse_kv.static"),
    "hf_sparse_kv.policies": ("hf_sparse_kv.ops", "hf_sparse_kv.policies"),
    "hf_sparse_kv.crossover": (),
    "hf_sparse_kv.prefill": ("hf_sparse_kv.ops",),
    "hf_sparse_kv.attention": (
        "hf_sparse_kv.cache", "hf_sparse_kv.crossover", "hf_sparse_kv.policies", "hf_sparse_kv.prefill",
        "hf_sparse_kv.runtime", "hf_sparse_kv.ops",
    ),
    "hf_sparse_kv.patched": (),
    "hf_sparse_kv.merge": ("hf_sparse_kv.ops",),
    "hf_sparse_kv.graphs": ("hf_sparse_kv.attention", "hf_sparse_kv.cache", "hf_sparse_kv.patched", "hf_sparse_kv.runtime"),
    "hf_sparse_kv.calibrate": ("hf_sparse_kv.attention", "hf_sparse_kv.crossover", "hf_sparse_kv.ops", "hf_sparse_kv.policies"),
    "hf_sparse_kv.calibrate_selector": ("hf_sparse_kv.policies",),
}  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, level: int, module: str, is_pkg: bool) -> str:
    if not level:
        return name
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the repository modules it imports, anywhere in the file (inside functions too)."""
    graph = {}
    for mod, path in modules.items():
        tree, is_pkg = ast.parse(path.read_text()), path.name == "__init__.py"
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node.module or "", node.level, mod, is_pkg)
                # "from pkg import submodule" depends on the submodule; "from module import name" on the module
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            for name in names:  # the longest repository module the name denotes
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    found.add(name)
        graph[mod] = found
    return graph


def test_no_import_circles_anywhere():
    modules = _modules()
    graph = _imports(modules)
    # benchmarks import their shared helpers as a top-level module ("from common import ...")
    graph = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, f"import circles: {cycles}"


def test_layers_import_only_downwards():
    graph = _imports(_modules())
    wrong = []
    for mod, targets in graph.items():
        rule = next((k for k in sorted(ALLOWED, key=len, reverse=True) if mod == k or mod.startswith(k + ".")), None)
        if rule is None:
            continue
        for t in targets:
            if t.startswith("hf_sparse_kv") and not any(t == a or t.startswith(a + ".") for a in ALLOWED[rule]):
                wrong.append(f"{mod} imports {t}")
    assert not wrong, wrong
    assert not any(t.startswith("transformers") for t in graph if t.startswith("hf_sparse_kv.ops"))


def test_no_module_writes_another_modules_objects():
    """Attribute writes on anything but ``self`` happen only where docs/ARCHITECTURE.md allows them: the cache module
    on its own BlockTable and layers, the patch on the model it patches (and its configs, restored on failure), the
    merge on the linear layers it merges for the patch."""
    allowed = {
        ("hf_sparse_kv.cache", "t"),
        ("hf_sparse_kv.cache", "layer"),
        ("hf_sparse_kv.patch", "model"),
        ("hf_sparse_kv.patch", "config"),
        ("hf_sparse_kv.patch", "generation_config"),  # the patch's own copy of it
        ("hf_sparse_kv.merge", "m"),  # the projections the patch merges (patch_model(merge_projections=True))
    }
    found = set()
    for mod, path in _modules().items():
        if not mod.startswith("hf_sparse_kv") or mod.startswith("hf_sparse_kv.ops.triton"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id not in ("self", "cls"):
                    found.add((mod, t.value.id))
    extra = {f"{m}: {n}.<attr> = ..." for m, n in found - allowed}
    # the runtime's Counters are written by their own module's session (a local alias of self.counters)
    extra.discard("hf_sparse_kv.runtime: c.<attr> = ...")
    assert not extra, sorted(extra)


# ---- the forced rule: one statement, host and device agree ------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16])
def test_forced_rule_host_and_device_agree(block_size):
    BS = block_size
    for n, sink, window in itertools.product(range(1, 75), (0, 1, 4, 9, 20), (0, 1, 5, 16, 33, 80)):
        width = L.cdiv(n, BS) + 1
        lens, start = torch.tensor([n]), torch.tensor([0])
        sink_end, win_start = L.window_positions(lens, start, sink, window)
        assert (int(sink_end), int(win_start)) == L.window_bounds(n, sink, window)
        mask = L.forced_block_mask(lens, start, sink, window, BS, width)[0]
        assert set(torch.nonzero(mask).flatten().tolist()) == L.forced_block_set(n, sink, window, BS), (n, sink, window)
        assert int(mask.sum()) == L.forced_block_count(n, sink, window, BS)
        tokens = L.forced_token_mask(lens, start, sink, window, BS, n)[0]
        assert int(tokens.sum()) == L.forced_token_count(n, sink, window, BS), (n, sink, window)
        assert bool(tokens[n - 1]) and bool(mask[L.cdiv(n, BS) - 1])  # the current token and block always


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_forced_block_bound_is_the_most_forced_blocks_at_any_length(block_size):
    """What a static step sizes its candidates by: never below the forced blocks of a length, reached by one."""
    for sink, window in itertools.product((0, 1, 4, 9, 20), (0, 1, 2, 5, 16, 33, 80)):
        most = max(L.forced_block_count(n, sink, window, block_size) for n in range(1, 300))
        assert L.forced_block_bound(sink, window, block_size) == most, (sink, window)


def test_cdiv():
    assert [L.cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert torch.equal(L.cdiv(torch.tensor([0, 1, 4, 5]), 4), torch.tensor([0, 1, 1, 2]))


@pytest.mark.parametrize("method", ["quest", "mean"])
def test_triton_scoring_forces_the_same_blocks(method):
    """The Triton kernel's transcription of the block rule against ``forced_block_mask`` (through ``+inf``)."""
    pytest.importorskip("triton")
    ops = get_ops(
        "triton", DEVICE
    )  # the interpreter on the CPU, the compiled kernel under HF_SPARSE_KV_TEST_DEVICE=cuda
    g = torch.Generator().manual_seed(3)
    BS, H, G, D = 8, 2, 2, 16
    lens = torch.tensor([1, 7, 8, 9, 40, 63, 64, 100], dtype=torch.int32)
    start = torch.tensor([0, 0, 3, 0, 5, 0, 2, 0], dtype=torch.int32)
    B, MB = len(lens), L.cdiv(100, BS) + 1
    table = torch.arange(B * MB, dtype=torch.int32).view(B, MB)
    meta = [torch.randn(B * MB, H, D, generator=g) for _ in range(3)]
    q = torch.randn(B, H * G, D, generator=g)
    for sink, window in ((0, 1), (4, 8), (13, 30)):
        on = [t.to(DEVICE) for t in (q, *meta, table, lens)]
        s = ops.block_scores(*on, BS, method, start.to(DEVICE), sink, window).cpu()
        forced = L.forced_block_mask(lens, start, sink, window, BS, MB)
        assert torch.equal(torch.isposinf(s), forced.unsqueeze(1).expand_as(s)), (sink, window)
