"""Triton kernels built ahead, in parallel: record the specializations a run compiled, build them first next time.

A Triton kernel compiles on its first launch with each new specialization (its ``tl.constexpr`` tile sizes, which
follow a table's width and a budget; its integer arguments' divisibility), on the host, one at a time, while the
GPU waits. Triton keeps every build in its cache folder (``~/.triton/cache``, ``$TRITON_CACHE_DIR``), so only a
machine's first run pays: on a fresh H100, Qwen2.5's grid spent ~60 s of its first batches so
(evaluation/RESULTS.md, 2026-12-06).

- :func:`record` appends each specialization of this package's kernels that the process compiles (Triton's
  ``jit_post_compile_hook`` and its ``specialization_data``, one JSON object a line) to a file;
- :class:`Prebuild` builds a file's specializations in worker processes into the same cache folder (Triton's
  ``JITFunction.preload``, for the current GPU's target; the workers never touch the GPU), so that the run's
  launches, which start after its model loaded, find them built. A launch that comes first builds its kernel
  itself, as without this; a specialization that no longer fits the code (a kernel renamed or given other
  parameters) is counted as failed and skipped.

Both are for GPU runs; on the CPU the kernels run in Triton's interpreter and nothing compiles.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path

PACKAGE = "hf_sparse_kv."  # only this package's kernels are recorded and built
SPECS_ENV = "HF_SPARSE_KV_KERNEL_SPECS"  # `hf-sparse-kv suite`'s default --kernel-specs


def read_specs(path: str | Path) -> list[str]:
    """The specializations in ``path`` (one JSON object a line, as :func:`record` writes them), each once, in the
    order first written; ``[]`` for a missing file. A line that is not such an object is an error naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    specs: dict[str, None] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            name = json.loads(line)["name"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Triton specialization ({type(e).__name__}: {e})") from None
        if not isinstance(name, str) or not name.startswith(PACKAGE):
            raise ValueError(f"{path}:{n}: kernel {name!r} is not one of {PACKAGE.rstrip('.')}'s")
        specs[line] = None
    return list(specs)


@contextmanager
def record(path: str | Path):
    """Within: every specialization of this package's kernels that this process compiles (or loads from Triton's
    cache: either is a first launch in the process) and ``path`` lacks is appended to it. Another post-compile hook
    set before is called as well, and restored after."""
    from triton import knobs

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen = set(read_specs(path))
    lock = threading.Lock()
    before = knobs.runtime.jit_post_compile_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        spec = compile["specialization_data"]
        if spec.startswith("{") and json.loads(spec)["name"].startswith(PACKAGE):
            with lock:
                if spec not in seen:
                    seen.add(spec)
                    with path.open("a") as f:
                        f.write(spec + "\n")
        if before is not None:
            return before(
                key=key,
                repr=repr,
                fn=fn,
                compile=compile,
                is_manual_warmup=is_manual_warmup,
                already_compiled=already_compiled,
            )
        return None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield path
    finally:
        knobs.runtime.jit_post_compile_hook = before


class TargetDriver:
    """Just enough of a Triton driver to compile for ``target`` (``GPUTarget``) without a GPU: device 0, stream 0.
    Installed in :class:`Prebuild`'s workers (and by ``tests/compile_sm90.py``)."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def kernel(name: str):
    """This package's Triton kernel named ``module.function`` (a specialization's ``name``)."""
    if not name.startswith(PACKAGE):
        raise ValueError(f"kernel {name!r} is not one of {PACKAGE.rstrip('.')}'s")
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _worker_init(target: tuple) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(TargetDriver(GPUTarget(*target)))


def _build(spec: str) -> tuple[str, float, str | None]:
    """Build one specialization into Triton's cache folder (in a worker): ``(name, seconds, error or None)``."""
    t0 = time.monotonic()
    name = json.loads(spec)["name"]
    try:
        kernel(name).preload(spec)
    except Exception as e:  # noqa: BLE001 - the code changed since it was recorded: the run builds it itself
        return name, time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return name, time.monotonic() - t0, None


class Prebuild:
    """Build ``specs`` (:func:`read_specs`) for ``target`` (``(backend, arch, warp_size)``, e.g. ``("cuda", 90,
    32)``; ``None``: the current GPU's) in ``workers`` processes, in the background, into Triton's cache folder as
    this process's environment names it. :meth:`wait` for all (or up to a time), :meth:`summary` to say how it
    went, :meth:`close` to stop: specializations not started are dropped."""

    def __init__(self, specs: list[str], workers: int, target: tuple | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if target is None:
            from triton.runtime import driver

            t = driver.active.get_current_target()
            target = (t.backend, t.arch, t.warp_size)
        self.t0 = time.monotonic()
        self.pool = ProcessPoolExecutor(
            workers, mp_context=get_context("spawn"), initializer=_worker_init, initargs=(tuple(target),)
        )
        self.futures: list[Future] = [self.pool.submit(_build, s) for s in specs]
        self.ended: list[float] = []  # when each build ended (its future's callback)
        for f in self.futures:
            f.add_done_callback(lambda _: self.ended.append(time.monotonic()))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every build, at most ``timeout`` seconds: whether all ended."""
        end = None if timeout is None else time.monotonic() + timeout
        for f in self.futures:
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                f.result(left)
            except Exception:  # noqa: BLE001 - a timeout, or a worker that died
                return all(g.done() for g in self.futures)
        return True

    def summary(self) -> str:
        """``"N of M built (F failed, first: ...) in S s"`` (S: from the start to the last build's end), or, while
        some are pending, ``"..., P pending after S s"`` (S: so far)."""
        done = [f for f in self.futures if f.done()]
        errors = [f.result()[2] for f in done if f.exception() is None and f.result()[2]]
        broken = [f for f in done if f.exception() is not None]
        built = len(done) - len(errors) - len(broken)
        text = f"{built} of {len(self.futures)} built"
        if errors or broken:
            first = errors[0] if errors else repr(broken[0].exception())
            text += f" ({len(errors) + len(broken)} failed, first: {first[:200]})"
        pending = len(self.futures) - len(done)
        if pending:
            return f"{text}, {pending} pending after {time.monotonic() - self.t0:.1f} s"
        # a future's callbacks run just after its waiters wake: one not yet run leaves the end at "now"
        last = max(self.ended) if len(self.ended) == len(self.futures) else time.monotonic()
        return f"{text} in {last - self.t0:.1f} s"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def default_workers() -> int:
    """Worker processes for :class:`Prebuild`: the cores less two (the run's own threads), at most 8, at least 1."""
    return max(1, min(8, (os.cpu_count() or 1) - 2))


def builds_kernels() -> bool:
    """Whether Triton kernels compile in this process: a CUDA GPU, Triton importable, no ``TRITON_INTERPRET``."""
    import torch

    if os.environ.get("TRITON_INTERPRET") or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def ahead(path: str | Path | None, workers: int | None = None, log=print):
    """Within (a run that then loads its model and runs): ``path``'s specializations building in ``workers``
    processes (:class:`Prebuild`, default :func:`default_workers`) and each new one this process compiles appended
    to ``path`` (:func:`record`); at the end, a line to ``log`` on how the builds went. Nothing without a ``path``
    or where no kernel compiles (:func:`builds_kernels`)."""
    if path is None or not builds_kernels():
        yield None
        return
    specs = read_specs(path)
    prebuild = None
    if specs:
        workers = workers or default_workers()
        prebuild = Prebuild(specs, workers)
        log(f"[kernels] building {len(specs)} recorded specializations ahead in {workers} processes")
    try:
        with record(path):
            yield prebuild
    finally:
        if prebuild is not None:
            log(f"[kernels] ahead: {prebuild.summary()}")
            prebuild.close()
        log(f"[kernels] {len(read_specs(path)) - len(specs)} new specializations recorded in {path}")
