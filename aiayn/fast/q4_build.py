"""Builds and loads aiayn's C++ kernels (``q4_kernel.cpp`` and others) on first use: ``load_inline``
with ``-march=native`` into torch's extension cache, named by a hash of source, flags and CPU, so a
later process loads it in milliseconds. Without a compiler, or with ``AIAYN_Q4_KERNEL=0``,
``kernel_ops()`` is None (``BlockLinear`` dequantises instead)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import warnings
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("q4_kernel.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17"]
# at::parallel_for runs serially in code compiled without OpenMP: -fopenmp links torch's libgomp
# (one thread pool); a compiler without OpenMP gets the serial build (``parallel()`` says False).
OPENMP = "-fopenmp"


OPS: Any | None = None  # torch.ops.aiayn_q4 once loaded (read by compiled graphs as a constant)


@lru_cache(maxsize=1)
def kernel_ops() -> Any | None:
    """``torch.ops.aiayn_q4`` once built (None where it cannot be); call it before compiling."""
    global OPS
    if os.environ.get("AIAYN_Q4_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    loaded = hasattr(torch.ops.aiayn_q4, "matmul")  # by an earlier call in this process
    OPS = torch.ops.aiayn_q4 if loaded else _build()
    return OPS


def build_name(flags: list[str]) -> str:
    """The 4-bit extension's name in torch's cache (``kernel_name``)."""
    return kernel_name(SOURCE, "aiayn_q4_", flags)


def kernel_name(source: Path, prefix: str, flags: list[str]) -> str:
    """An extension's name in torch's cache: a hash of the source, the flags, torch's version and the CPU."""
    key = source.read_text(encoding="utf-8") + " ".join(flags) + torch.__version__ + cpu_identity()
    return prefix + hashlib.sha256(key.encode()).hexdigest()[:12]


@lru_cache(maxsize=1)
def cpu_identity() -> str:
    """What ``-march=native`` compiles for (/proc/cpuinfo's model and flags, else the platform's)."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        info = ""
    wanted = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    lines = [line.strip() for line in info.split("\n\n", 1)[0].splitlines() if line.split(":", 1)[0].strip() in wanted]
    return "\n".join(lines) or f"{platform.machine()} {platform.processor()}"


@contextlib.contextmanager
def _one_builder(name: str) -> Iterator[None]:
    """An OS lock (``flock``, released however its holder dies) around a build, whose holder removes a
    ``lock`` file a killed build left (torch would wait on it forever)."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory  # creates the directory

        build_dir = Path(_get_build_directory(name, False))
        handle = open(build_dir / "aiayn-build.lock", "a", encoding="utf-8")  # noqa: SIM115 (closed below)
    except (ImportError, AttributeError, TypeError, OSError):  # no flock (Windows), another torch, read-only
        yield  # torch's own lock alone
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits for a live builder, never for a dead one
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build() -> Any | None:
    return build_kernel(SOURCE, "aiayn_q4_", FLAGS, "4-bit kernel", _register_fakes, lambda: torch.ops.aiayn_q4,
                        fallback="block-quantised layers dequantise their weights for every call instead (slow)")


def build_kernel(source: Path, prefix: str, base_flags: list[str], what: str, register_fakes: Callable[[], None],
                 ops: Callable[[], Any], *, fallback: str) -> Any | None:
    """Build and load a C++ kernel with OpenMP, else serially, register its fake shapes and return
    ``ops()``; where it cannot be built, one warning naming the compiler's last line, and None."""
    text = source.read_text(encoding="utf-8")
    error: Exception | None = None
    for extra in ([OPENMP], []):  # with OpenMP (threads), else serial
        flags = base_flags + extra
        name = kernel_name(source, prefix, flags)
        try:
            from torch.utils.cpp_extension import load_inline

            with _one_builder(name):
                load_inline(name, cpp_sources=[text], no_implicit_headers=True, is_python_module=False,
                            extra_cflags=flags, extra_ldflags=extra, verbose=False)
        except Exception as exc:  # no compiler, no ninja, no OpenMP, a build error
            error = exc
            continue
        if not extra:
            warnings.warn(f"aiayn's {what} was built without OpenMP (the compiler refused -fopenmp): "
                          "it runs on one thread", stacklevel=3)
        register_fakes()
        return ops()
    message = str(error).strip()
    first = message.splitlines()[-1] if message else type(error).__name__
    warnings.warn(f"aiayn's {what} could not be built ({first[:200]}); {fallback}", stacklevel=3)
    return None


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing (the ops allocate their results themselves)."""

    @torch.library.register_fake("aiayn_q4::matmul")
    def _matmul(x, q, scale, mins, offset, block, nibbles, n, k):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("aiayn_q4::dequantize")
    def _dequantize(q, scale, mins, offset, block, nibbles, n, k, rows):  # type: ignore[no-untyped-def]
        return q.new_empty(n if rows is None else rows.numel(), k, dtype=torch.float32)
