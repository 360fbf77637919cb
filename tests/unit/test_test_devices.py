"""The test suite's own device switch (tests/conftest.py): ``AIAYN_TEST_DEVICES`` parametrises the
``device`` fixture, a device this machine lacks stops the run with a usage error, and in
tests/parity and tests/consistency a test must take ``device`` or be marked ``cpu_only``.

Each case runs pytest in a subprocess on a scratch tree holding a copy of the real conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

SCRATCH_TESTS = '''
import pytest
import torch


def test_takes_device(device):
    assert isinstance(device, torch.device) and torch.ones(1, device=device).device == device


@pytest.mark.cpu_only
def test_cpu_only():
    pass


def test_neither():
    pass


@pytest.mark.cpu_only
def test_both(device):
    pass
'''


def run_pytest(tmp_path: Path, devices: str | None, *args: str) -> subprocess.CompletedProcess:
    """pytest on a scratch ``tests/`` with the real conftest and one parity module."""
    (tmp_path / "tests" / "parity").mkdir(parents=True, exist_ok=True)
    shutil.copy(TESTS / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "parity" / "test_scratch.py").write_text(SCRATCH_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "AIAYN_TEST_DEVICES"}
    if devices is not None:
        env["AIAYN_TEST_DEVICES"] = devices
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN", *args, "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_default_is_the_cpu_and_the_layout_rule_fails_loudly(tmp_path):
    result = run_pytest(tmp_path, None)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "2 passed, 2 errors" in out  # failed at setup, before the test runs
    assert "test_neither neither takes `device` nor is marked cpu_only" in out
    assert "test_both[cpu] both takes `device` and is marked cpu_only" in out


def test_ids_name_the_devices_listed_once_each(tmp_path):
    result = run_pytest(tmp_path, " cpu, CPU ,", "--collect-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "test_scratch.py::test_takes_device[cpu]" in result.stdout
    assert "4 tests collected" in result.stdout


def test_a_device_this_machine_lacks_is_a_usage_error(tmp_path):
    result = run_pytest(tmp_path, "cpu,cuda:99")  # no machine here has 100 GPUs
    assert result.returncode == 4, result.stdout + result.stderr
    assert "AIAYN_TEST_DEVICES names 'cuda:99', which this machine lacks" in result.stderr
    assert "passed" not in result.stdout
    result = run_pytest(tmp_path, " , ")
    assert result.returncode == 4 and "names no device" in result.stderr
