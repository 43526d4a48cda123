"""benchmarks/bench_split.py: kernel names put into categories (every Triton kernel of ours among them), whether a
captured row's replays were seen by the profiler (from made-up events: both cases, since which one a GPU gives depends
on its CUDA / CUPTI), and a dry run on the CPU at a tiny shape. No speed is checked."""

import csv
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_split

ATTENTION_KERNELS = {"sparse_decode_fwd_kernel", "merge_partials_kernel"}
WRITE_KERNELS = {
    "paged_write_kernel", "projected_write_kernel", "quant_write_kernel", "pq_write_kernel", "pq_encode_kernel",
    "fp8_write_kernel",
}  # fmt: skip
MATMUL_KERNELS = {"decode_linear_kernel"}


def test_every_triton_kernel_of_ours_has_its_category():
    """The decode and merge kernels are attention, the writes (and their state's refresh) write, the weights' decode
    matmul matmul, every other kernel (scoring, top-k) selection: a new kernel that is none of these fails here until
    bench_split knows it."""
    kernels = set()
    for path in (ROOT / "hf_sparse_kv" / "ops" / "triton").glob("*.py"):
        kernels |= set(re.findall(r"^def (\w+_kernel)\(", path.read_text(), re.MULTILINE))
    assert ATTENTION_KERNELS | WRITE_KERNELS | {"block_scores_kernel", "topk_indices_kernel"} <= kernels
    expected = {k: "attention" if k in ATTENTION_KERNELS else "write" if k in WRITE_KERNELS
                else "matmul" if k in MATMUL_KERNELS else "selection" for k in kernels}  # fmt: skip
    assert {k: bench_split.category(k) for k in kernels} == expected


@pytest.mark.parametrize(
    "name, category",
    [
        ("triton_poi_fused__to_copy_add_mul_0", "fused"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "fused"),
        ("triton_per_fused_add_mean_2", "fused"),
        ("triton_tem_fused_mm_3", "matmul"),  # inductor's GEMM template
        # inductor's kernels named after the op of ours they feed (seen on the H200): fused, not write / attention
        ("triton_poi_fused__to_copy__unsafe_view_add_bmm_cat_cos_mul_neg_paged_write_4", "fused"),
        ("triton_poi_fused__to_copy__unsafe_view_add_arange_cat_clone_cos_decode_blocks_2", "fused"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "matmul"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "matmul"),
        # SDPA's kernels name cutlass in their template arguments: attention first
        ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_traits<cutlass::bfloat16_t>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2>, unsigned int, 4, 64, 64>", "rest"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "rest"),
        ("Memcpy DtoD (Device -> Device)", "rest"),
        ("hf_sparse_kv::paged_write", "write"),  # the CPU dry run: our ops, the reference functions, aten's matmuls
        ("decode_blocks", "attention"),
        ("oracle_block_scores", "selection"),
        ("aten::mm", "matmul"),
        ("aten::mul", "rest"),
    ],
)
def test_category_by_kernel_name(name, category):
    assert bench_split.category(name) == category


def _launch(i: int):
    return SimpleNamespace(name="cudaGraphLaunch", device_type=DeviceType.CPU, id=i, is_user_annotation=False)


def _kernel(name: str, i: int, start: float, end: float):
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, id=i, is_user_annotation=False,
                           time_range=Interval(start, end))  # fmt: skip


ARGMAX = "void at::native::reduce_kernel<ArgMaxOps<float>>"  # the next token's, outside the graph


def _row(events, graph: bool = True) -> dict:
    parts = bench_split.split(events, steps=1, on_gpu=True)
    return bench_split.row_result((1, 1024), "graph: Quest 1/16 block", [0.030], parts, (True, graph), 10**9)


def test_a_traced_replay_is_split_and_its_bubbles_measured():
    events = [_launch(7), _kernel("nvjet_tst_64x8", 7, 0.0, 10.0), _kernel("sparse_decode_fwd_kernel", 7, 12.0, 15.0),
              _kernel("triton_poi_fused_add_0", 7, 15.0, 16.0), _kernel(ARGMAX, 9, 20.0, 21.0)]  # fmt: skip
    row = _row(events)
    assert row["note"] is None and row["kernels"] == 4 and row["graph_kernels"] == 3
    assert row["gpu_us"] == 15 and row["gap_us"] == pytest.approx(30_000 - 15)
    assert row["bubble_us"] == 2  # 16 µs from the replay's first kernel to its last, 14 of them busy
    assert (row["mm_us"], row["attn_us"], row["fused_us"], row["rest_us"]) == (10, 3, 1, 1)
    assert row["mm_gb_s"] == pytest.approx(1e9 / 10e-6 / 1e9)  # weight bytes over the matmul time


def test_an_untraced_replay_reports_no_split_rather_than_zeros():
    row = _row([_launch(7), _kernel(ARGMAX, 9, 20.0, 21.0)])
    assert "does not trace graph replays" in row["note"]
    assert all(row[k] is None for k in ("kernels", "gpu_us", "gap_us", "bubble_us", "mm_us", "attn_us", "rest_us"))
    assert row["wall_ms"] == pytest.approx(30.0)  # the wall clock was measured


def test_replayed_kernels_without_their_launch_id_still_split():
    row = _row([_launch(7), _kernel("nvjet_tst_64x8", 8, 0.0, 10.0), _kernel(ARGMAX, 9, 20.0, 21.0)])
    assert "correlation id" in row["note"] and row["gpu_us"] == 11 and row["bubble_us"] is None


def test_a_graph_row_without_a_graph_launch_says_it_ran_eagerly():
    row = _row([_kernel("nvjet_tst_64x8", 8, 0.0, 10.0)])
    assert "ran eagerly" in row["note"] and row["gpu_us"] == 10
    assert _row([_kernel("nvjet_tst_64x8", 8, 0.0, 10.0)], graph=False)["note"] is None  # an eager row


def _run(monkeypatch, tmp_path, rows: str) -> None:
    argv = ["bench_split.py", "--device", "cpu", "--tiny", "--shapes", "1x64", "--steps", "1", "--warmup", "1",
            "--rows", rows, "--out", str(tmp_path / "split.csv")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_split.main()


def test_bench_split_dry_run_profiles_eager_captured_and_compiled_rows(monkeypatch, tmp_path):
    names = ["unpatched sdpa", "Quest 1/16 block", "graph+compile: Quest 1/16 block"]
    _run(monkeypatch, tmp_path, ",".join(names))
    with open(tmp_path / "split.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert list(rows) == names
    for name in names[1:]:
        assert all(float(rows[name][f"{c}_us"]) > 0 for c in ("sel", "attn", "write", "mm"))
    assert float(rows["unpatched sdpa"]["sel_us"]) == 0 and float(rows["unpatched sdpa"]["attn_us"]) > 0
    assert "CPU" in rows["graph+compile: Quest 1/16 block"]["note"] and not rows["Quest 1/16 block"]["note"]


def test_bench_split_refuses_an_unknown_row(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        _run(monkeypatch, tmp_path, "graph+compile: Quest 1/16 blocks")


def test_python_events_are_told_apart_without_the_attribute():
    """torch 2.11's profiler events have no ``is_python_function``: the name's form tells the same events apart."""
    import torch
    from torch.profiler import profile

    def f(x):
        return (x * 2).sum()

    with profile(with_stack=True) as prof:
        f(torch.ones(3))
    events = list(prof.events())
    if not hasattr(events[0], "is_python_function"):
        pytest.skip("this torch's profiler events do not say which are Python functions (torch 2.11)")
    assert any(e.is_python_function for e in events) and any(not e.is_python_function for e in events)
    for e in events:
        assert bench_split.is_python(SimpleNamespace(name=e.name)) == bool(e.is_python_function), e.name


def test_a_cpu_op_without_python_parents_takes_its_category_from_its_stack():
    """Where the profiler records no Python functions as events (torch 2.11), an op's own stack names ours."""
    frames = ["hf_sparse_kv/ops/reference.py(380): _attend", "hf_sparse_kv/ops/reference.py(427): decode_blocks"]
    op = SimpleNamespace(name="aten::mul", cpu_parent=None, stack=frames + ["modeling_llama.py(295): forward"])
    assert bench_split.cpu_category(op) == "attention"
    assert bench_split.cpu_category(SimpleNamespace(name="aten::mm", cpu_parent=None, stack=[])) == "matmul"
    plain = SimpleNamespace(name="aten::mul", cpu_parent=None, stack=["modeling_llama.py(295): forward"])
    assert bench_split.cpu_category(plain) == "rest"
