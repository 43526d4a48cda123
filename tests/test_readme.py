"""The README tells a new user what they need first, and agrees with what the demo prints."""

import argparse
import re
from pathlib import Path

from evaluation import demo

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def demo_header(capsys) -> list[str]:
    """The demo table's title and column line, as ``make demo`` prints them (no rows)."""
    args = argparse.Namespace(model="smollm2", context=4096, budget=0.125, mode="block", block_size=16)
    demo.print_table([], args)
    return capsys.readouterr().out.strip().splitlines()[:2]


def test_demo_names_its_exact_model_as_the_readme_shows(capsys):
    title, _ = demo_header(capsys)
    assert title.startswith("SmolLM2-135M-Instruct (Q4_1 GGUF),")
    assert title in README  # the README's copy of the demo output has the same title


def test_every_demo_column_is_explained(capsys):
    _, columns = demo_header(capsys)
    names = re.split(r"\s{2,}|\s(?=[a-z])", columns.strip())
    assert names == ["policy", "answer", "ok", "agree", "ms/token", "KV MB/step", "ppl"]
    for name in names:
        assert f"- `{name}`" in README or f"; `{name}`:" in README, name
    ms = " ".join(README[README.index("- `ms/token`") :].split("\n- ")[0].split())
    assert "not** a speed claim" in ms and "benchmarks/RESULTS.md" in ms


def test_readme_shows_how_to_load_a_model():
    section = README[README.index("## Loading a model") : README.index("## The two commands")]
    for needle in (
        "AutoModelForCausalLM.from_pretrained(",
        "evaluation.assets.load_model",
        "gguf_file=",
        "model.model",
    ):
        assert needle in section, needle


def test_readme_has_the_tensor_parallel_command():
    section = README[README.index("## Tensor parallelism") :].split("\n## ")[0]
    assert "torchrun --standalone --nproc-per-node 2 benchmarks/bench_tp.py" in section
    assert "tests/test_tensor_parallel.py" in section
