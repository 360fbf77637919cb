"""Cooperative sharing of the CPU cores between aiayn processes on one machine (jobs of one thread per
core each oversubscribe the cores). At its safe points a busy process renews a file ``<pid>`` in a
per-user registry folder (busy until its modification time), counts the live busy processes and
sets ``torch.set_num_threads(max(1, cores // busy))``. A thread count someone chose is kept;
``AIAYN_SHARE_CPUS=0`` turns sharing off."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV_SWITCH = "AIAYN_SHARE_CPUS"  # "0" (or "off", "false", "no"): never register nor change threads
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # a user's count: torch takes it, so do we
CHECK_EVERY = 0.5  # seconds between two looks at the registry (the first call looks at once)
BUSY_FOR = 2.0  # seconds a renewal counts the process busy (at least; 3 gaps between safe points)
MAX_GAP = 10.0  # a longer gap between safe points was idle time (waiting for input), not a slow step
FOLDER_NAME = "aiayn-cpu-share"

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether sharing is on (``AIAYN_SHARE_CPUS`` unset or anything but 0/off/false/no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def registry_folder() -> Path | None:
    """The per-user, per-machine folder (created mode 0700), or None when none is safe to use."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = Path(base) / f"{FOLDER_NAME}-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        return None
    return folder


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fair_share(full: int, busy: int, cores: int | None = None) -> int:
    """Threads for one of ``busy`` busy processes: ``full`` alone, else the cores split evenly, at
    least 1 and never more than ``full``."""
    if busy <= 1:
        return full
    cores = min(full, usable_cores() if cores is None else cores)
    return max(1, min(full, cores // busy))


def start_time(pid: int) -> str | None:
    """The process's start time as the kernel records it (/proc/PID/stat field 22), None without /proc."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its ")".
    fields = stat_line[stat_line.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` exists and is the one that started at ``started`` (when known)."""
    try:
        os.kill(pid, 0)
    except PermissionError:  # exists, another user's (not in a per-user folder, but be safe)
        pass
    except OSError:  # ProcessLookupError among them
        return False
    return started is None or start_time(pid) in (None, started)


@dataclass
class _ThreadState:
    """Per OS thread (torch's count is per thread): what sharing set, and whether the count is the user's."""

    full: int | None = None  # torch's default here when sharing first looked
    last_set: int | None = None  # what sharing last set (or found)
    kept: bool = False  # the count is someone's choice: never change it


class CpuShare:
    """The registry of busy aiayn processes, seen from this one (``SHARE``); the arguments are for tests."""

    def __init__(self, folder: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self._folder = folder
        self._clock = clock
        self.pid = os.getpid()
        self._file: Path | None = None
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._last_call: float | None = None
        self._threads = threading.local()
        self.keep = False  # --threads: the count is the user's in every thread
        self.off = False  # the registry cannot be used (no safe folder): do nothing from now on

    # ---- the registry ------------------------------------------------------------------------
    def _register(self) -> Path | None:
        if self._file is not None or self.off:
            return self._file
        folder = self._folder if self._folder is not None else registry_folder()
        if folder is None:
            self.off = True
            return None
        self._folder = folder
        path = folder / str(self.pid)
        try:
            path.write_text(f"{start_time(self.pid) or ''}\n")
        except OSError:
            self.off = True
            return None
        self._file = path
        return path

    def forked(self) -> None:
        """In a forked child: a process of its own, registered at its own first safe point."""
        self.pid, self._file, self._next_check, self._last_call = os.getpid(), None, 0.0, None
        self._lock = threading.Lock()

    def unregister(self) -> None:
        """Remove this process's file (at exit)."""
        if self._file is not None and os.getpid() == self.pid:  # not in a forked child
            with contextlib.suppress(OSError):
                self._file.unlink()
        self._file = None

    def renew(self, busy_until: float) -> None:
        """Say this process is busy until ``busy_until`` (the file's modification time)."""
        if self._file is not None:
            try:
                os.utime(self._file, (busy_until, busy_until))
            except FileNotFoundError:  # someone cleaned the folder: register again
                self._file = None
                if self._register() is not None:
                    os.utime(self._file, (busy_until, busy_until))

    def busy_processes(self, now: float) -> int:
        """Live registered processes busy at ``now``; removes the files of processes that ended."""
        count = 0
        if self._folder is None:
            return count
        for entry in os.scandir(self._folder):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                busy_until = entry.stat().st_mtime
                started = None if pid == self.pid else Path(entry.path).read_text().strip() or None
            except OSError:
                continue
            if pid != self.pid and not alive(pid, started):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            count += busy_until >= now
        return count

    # ---- the safe point ----------------------------------------------------------------------
    def share_cores(self) -> None:
        """The safe point: every ``CHECK_EVERY`` s, renew this process's claim and set this thread's count
        to its fair share (unless the count is kept)."""
        now = self._clock()
        gap = 0.0 if self._last_call is None else now - self._last_call
        self._last_call = now
        if now < self._next_check or self.off:
            return
        if not self._lock.acquire(blocking=False):  # another thread of ours is looking
            return
        try:
            self._next_check = now + CHECK_EVERY
            if self._register() is None:
                return
            self.renew(now + max(BUSY_FOR, 3 * min(gap, MAX_GAP)))
            self._adjust(self.busy_processes(now))
        except OSError:  # the folder went away or is unreadable: stop sharing, keep computing
            self.off = True
        finally:
            self._lock.release()

    def _adjust(self, busy: int) -> None:
        import torch  # imported by the caller already (it runs a model); this module stays light

        state = self._threads.__dict__.setdefault("state", _ThreadState())
        current = torch.get_num_threads()
        if state.full is None:  # first look from this thread: whose count is it?
            state.full = state.last_set = current
            state.kept = (self.keep or any(os.environ.get(name) for name in THREAD_ENV)
                          or current != default_threads())
        elif current != state.last_set:  # set by someone else since we last looked
            state.kept = True
        if state.kept or self.keep:
            return
        wanted = fair_share(state.full, busy)
        if wanted != current:  # logged: a job that slows down says why (logging at DEBUG)
            logger.debug("%d busy aiayn processes: %d threads instead of %d", busy, wanted, current)
            torch.set_num_threads(wanted)
        state.last_set = wanted


def default_threads() -> int:
    """torch's own default intra-op count (its physical cores, when no variable sets one)."""
    import torch

    return torch.get_num_interop_threads()


SHARE = CpuShare()
atexit.register(SHARE.unregister)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SHARE.forked)


def share_cores() -> None:
    """The hook for a safe point; nothing when ``AIAYN_SHARE_CPUS=0``."""
    if enabled():
        SHARE.share_cores()


def keep_thread_count() -> None:
    """The user chose the thread count (``--threads``): never change it in this process."""
    SHARE.keep = True

