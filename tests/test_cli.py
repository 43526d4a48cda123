"""The command line: a help that lists the commands, policy names as in the registry or as classes, and every
mistake in a recipe or a flag reported in one line (exit code 2) before any model loads."""

import pytest

import evaluation.recipes
from evaluation.cli import main
from evaluation.sweep import policy_grid
from hf_sparse_kv.policies import Quest, SinkWindow


class Loaded(Exception):
    """Raised in place of loading a model: the command got past its checks."""


@pytest.fixture
def no_model(monkeypatch):
    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(evaluation.recipes, "load_model_from", load)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_and_exits_0(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([flag])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "calibrate", "run", "eval"):
        assert any(line.split()[:1] == [name] and len(line.split()) > 1 for line in out.splitlines()), name


def test_no_or_unknown_command_exits_2(capsys):
    for argv in ([], ["bogus"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "commands:" in capsys.readouterr().err


def test_policy_names_and_class_names_are_the_same_policies():
    cells = policy_grid([{"name": "Quest"}, {"name": "quest"}, {"name": "SinkWindow", "sink": 4}], [0.125])
    assert [type(c.policy) for c in cells] == [Quest, Quest, SinkWindow]
    assert [c.label for c in cells] == ["quest", "quest", "sink_window"]  # one label however it was spelled


def one_line_error(capsys, argv: list[str], *needles: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-sparse-kv: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.usefixtures("no_model")
def test_bad_flags_are_reported_before_loading_a_model(capsys, tmp_path):
    out = ["--output", str(tmp_path / "out")]
    one_line_error(capsys, ["eval", "perplexity", "--policies", "bogus", *out], "bogus", "sink_window", "SinkWindow")
    one_line_error(capsys, ["eval", "needle", "--budgets", "1/0", *out], "1/0")
    one_line_error(capsys, ["eval", "needle", "--budgets", "-0.5", "--policies", "quest", *out], "budget")
    one_line_error(capsys, ["eval", "qa", "--block-size", "12", *out], "block_size")
    one_line_error(capsys, ["eval", "qa", "--set", "mode=sparse", *out], "mode")
    one_line_error(capsys, ["eval", "qa", "--set", "nothing", *out], "KEY=VALUE")
    one_line_error(capsys, ["eval", "qa", "--lengths", "0", *out], "lengths")


@pytest.mark.usefixtures("no_model")
def test_bad_recipe_files_are_reported_before_loading_a_model(capsys, tmp_path):
    one_line_error(capsys, ["run", str(tmp_path / "missing.yaml")], "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: perplexity\npolicies: [{name: quest}, {name: Nope}]\n")
    good = tmp_path / "good.yaml"
    good.write_text(f"recipe: perplexity\noutput: {tmp_path / 'out'}\n")
    one_line_error(capsys, ["run", str(good), str(bad)], "bad.yaml", "'Nope'")  # the second file, before the first runs
    bad.write_text("recipe: summarize\n")
    one_line_error(capsys, ["run", str(bad)], "recipe must be one of")


@pytest.mark.usefixtures("no_model")
def test_good_flags_reach_the_model_loading(tmp_path):
    out = ["--output", str(tmp_path / "out")]
    with pytest.raises(Loaded):
        main(["eval", "perplexity", "--policies", "Dense", "Quest", "sink_window", "--budgets", "1/8", "64", *out])
