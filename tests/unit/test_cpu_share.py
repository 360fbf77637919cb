"""aiayn/cpu_share.py: busy aiayn processes split the cores, alone one keeps torch's default, a
count someone chose is kept, dead and idle processes do not count, and the switch turns it off.

The registry tests use their own folder, a controlled clock and a pretend machine (4 usable cores,
torch's default 4 threads), so they hold on any core count; the last test runs two real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from aiayn import cpu_share
from aiayn.cli.app import check_threads
from aiayn.cpu_share import CpuShare, fair_share

NOW = 1_000_000.0  # the controlled clock's time


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pretend 4-core machine whose torch default is 4 threads, this thread at the default,
    sharing on (the suite's conftest turns it off). conftest restores the thread count."""
    monkeypatch.setenv(cpu_share.ENV_SWITCH, "1")
    for name in cpu_share.THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_share, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu_share, "default_threads", lambda: 4)
    torch.set_num_threads(4)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def other_process(folder: Path, pid: int, *, busy_until: float, started: str | None = None) -> Path:
    """A registry file as another aiayn process leaves it."""
    path = folder / str(pid)
    path.write_text(f"{cpu_share.start_time(pid) if started is None else started}\n")
    os.utime(path, (busy_until, busy_until))
    return path


@pytest.fixture
def sleeper() -> subprocess.Popen:
    """A live process that is not this one (its pid stands for another aiayn job)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_fair_share_splits_the_cores_and_keeps_the_default_alone():
    assert fair_share(full=4, busy=1, cores=4) == 4
    assert fair_share(full=4, busy=0, cores=4) == 4  # not busy yet: unchanged
    assert fair_share(full=4, busy=2, cores=4) == 2
    assert fair_share(full=4, busy=3, cores=4) == 1
    assert fair_share(full=4, busy=9, cores=4) == 1  # never below one thread
    assert fair_share(full=8, busy=2, cores=16) == 4  # torch's default counts physical cores: those split
    assert fair_share(full=8, busy=2, cores=4) == 2  # affinity: 4 CPUs usable, 8 would oversubscribe


def test_alone_the_count_is_unchanged_and_the_file_says_busy(machine, tmp_path):
    clock = Clock()
    share = CpuShare(tmp_path, clock=clock)
    share.share_cores()
    assert torch.get_num_threads() == 4
    own = tmp_path / str(os.getpid())
    assert own.read_text().strip() == (cpu_share.start_time(os.getpid()) or "")
    assert os.stat(own).st_mtime == pytest.approx(NOW + cpu_share.BUSY_FOR)
    share.unregister()
    assert not own.exists()


def test_two_busy_processes_take_half_each_and_alone_again_the_whole(machine, tmp_path, sleeper):
    clock = Clock()
    share = CpuShare(tmp_path, clock=clock)
    share.share_cores()
    assert torch.get_num_threads() == 4
    other_process(tmp_path, sleeper.pid, busy_until=NOW + 5)
    clock.now += 0.1  # before the next look: nothing is read, nothing changes
    share.share_cores()
    assert torch.get_num_threads() == 4
    clock.now += cpu_share.CHECK_EVERY
    share.share_cores()
    assert torch.get_num_threads() == 2
    clock.now += 5.0  # the other one's claim ran out (it went idle): the whole machine again
    share.share_cores()
    assert torch.get_num_threads() == 4
    assert (tmp_path / str(sleeper.pid)).exists()  # idle, alive: its file stays


def test_a_dead_process_and_a_reused_pid_do_not_count_and_their_files_go(machine, tmp_path, sleeper):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = other_process(tmp_path, int(ended.stdout), busy_until=NOW + 60, started="1")
    # a live pid whose start time is not the recorded one: the pid was reused by another process
    reused = other_process(tmp_path, sleeper.pid, busy_until=NOW + 60, started="12345")
    if cpu_share.start_time(sleeper.pid) is None:
        reused.unlink()  # no /proc here: a reused pid cannot be told apart
    share = CpuShare(tmp_path, clock=Clock())
    share.share_cores()
    assert torch.get_num_threads() == 4
    assert not dead.exists() and not reused.exists()


@pytest.mark.parametrize("how", ["--threads", "OMP_NUM_THREADS", "set_num_threads before", "set_num_threads after"])
def test_a_chosen_thread_count_is_kept(machine, tmp_path, sleeper, monkeypatch, how):
    share = CpuShare(tmp_path, clock=Clock())
    monkeypatch.setattr(cpu_share, "SHARE", share)
    chosen = 3
    if how == "--threads":
        check_threads(chosen)  # the option's check: the user's count
        torch.set_num_threads(chosen)
    elif how == "OMP_NUM_THREADS":
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        chosen = 4  # even torch's default, when the variable says so
    elif how == "set_num_threads before":
        torch.set_num_threads(chosen)
    else:  # sharing looked alone first, then the user's code set a count
        cpu_share.share_cores()
        torch.set_num_threads(chosen)
    other_process(tmp_path, sleeper.pid, busy_until=NOW + 60)
    share._next_check = 0.0  # look now
    cpu_share.share_cores()
    assert torch.get_num_threads() == chosen
    assert (tmp_path / str(os.getpid())).exists()  # it still counts as busy for the others


def test_the_switch_turns_it_off(machine, tmp_path, sleeper, monkeypatch):
    monkeypatch.setenv(cpu_share.ENV_SWITCH, "0")
    share = CpuShare(tmp_path, clock=Clock())
    monkeypatch.setattr(cpu_share, "SHARE", share)
    other_process(tmp_path, sleeper.pid, busy_until=NOW + 60)
    cpu_share.share_cores()
    assert torch.get_num_threads() == 4
    assert not (tmp_path / str(os.getpid())).exists()


def test_a_folder_others_may_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = cpu_share.registry_folder()
    assert folder is not None and folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o777)
    assert cpu_share.registry_folder() is None
    share = CpuShare(clock=Clock())
    monkeypatch.setattr(cpu_share, "registry_folder", lambda: None)
    share.share_cores()
    assert share.off and share._file is None


# One real aiayn process (pretending 4 cores, torch's default 4 threads): it calls the hook every
# 20 ms and prints its thread count whenever it changes, for ``seconds``.
JOB = textwrap.dedent("""
    import sys, time
    import torch
    from aiayn import cpu_share
    cpu_share.usable_cores = lambda: 4
    cpu_share.default_threads = lambda: 4
    torch.set_num_threads(4)
    seen, end = None, time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        cpu_share.share_cores()
        if torch.get_num_threads() != seen:
            seen = torch.get_num_threads()
            print(f"{time.monotonic():.3f} {seen}", flush=True)
        time.sleep(0.02)
""")


def start_job(seconds: float, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", JOB, str(seconds)], env=env, stdout=subprocess.PIPE, text=True)


def test_two_real_processes_see_each_other_and_drop_to_half(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), cpu_share.ENV_SWITCH: "1"}
    for name in cpu_share.THREAD_ENV:
        env.pop(name, None)
    first = start_job(300.0, env)  # killed below
    line = first.stdout.readline().split()  # its first look: alone, torch's default
    assert line[1] == "4"
    second_started = time.monotonic()
    second = start_job(4.0, env)
    second_lines = second.stdout.read().split("\n")
    assert second.wait(timeout=60) == 0
    second_ended = time.monotonic()
    # the second saw the first at its first look: 2 threads from the start, never 4
    assert [row.split()[1] for row in second_lines if row] == ["2"]
    first_lines = []
    while len(first_lines) < 2:  # the first dropped to 2 while the second ran, then went back to 4
        first_lines.append(first.stdout.readline().split())
    first.kill()
    first.wait()
    (dropped_at, dropped), (back_at, back) = ((float(t), n) for t, n in first_lines)
    assert (dropped, back) == ("2", "4")
    # within a look (0.5 s) of the second's start (its interpreter and torch take a few seconds
    # to start), and within its claim (2 s) and a look after it ended
    assert second_started < dropped_at < second_ended
    assert back_at < second_ended + cpu_share.BUSY_FOR + cpu_share.CHECK_EVERY + 1.0
    folder = tmp_path / f"{cpu_share.FOLDER_NAME}-{os.getuid()}"
    assert (folder / str(first.pid)).exists() and not (folder / str(second.pid)).exists()  # killed; exited


def test_a_forked_child_is_a_process_of_its_own(machine, tmp_path):
    share = CpuShare(tmp_path, clock=Clock())
    share.share_cores()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its first safe point registers it under its own pid
        share.forked()
        share.share_cores()
        os.write(write, f"{share.pid} {(tmp_path / str(share.pid)).exists()}".encode())
        os._exit(0)
    os.close(write)
    answer = os.read(read, 100).decode().split()
    os.waitpid(child, 0)
    assert answer == [str(child), "True"]
    assert (tmp_path / str(os.getpid())).exists()  # the parent's file is the parent's
