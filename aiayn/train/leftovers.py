"""What a killed replacement (``aiayn train --overwrite``) leaves, and how the next start deals with it. The
sibling ``RUN.tmp-<hex>`` holds an owner lock (a flock the kernel drops when its process dies);
``clear_leftovers`` removes a sibling clearly dead and worthless, names the rest with the command that removes
them, and finishes a swap killed between its renames."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no owner locks; leftovers are named, never removed
    fcntl = None  # type: ignore[assignment]

from aiayn.train.run_files import CHECKPOINT_NAME, KIND_RUN, fsync_dir, read_marker

OWNER_LOCK = ".aiayn-owner"  # in a replacement's sibling, flocked by the process that writes it
LEFTOVER_AGE_S = 60.0  # a free lock younger than this may be one its owner has not yet locked

_OWNED: dict[Path, int] = {}  # temporary siblings this process writes -> its locked owner file


def _own(directory: Path) -> None:
    """Lock ``directory/OWNER_LOCK`` while this process lives; without locks no file is left."""
    if fcntl is None:
        return
    lock = directory / OWNER_LOCK
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        os.close(fd)
        lock.unlink(missing_ok=True)
        return
    _OWNED[directory] = fd


def _disown(directory: Path, *, now_at: Path | None) -> None:
    """Let go of the lock ``_own`` took on ``directory`` (renamed to ``now_at``: remove its file)."""
    fd = _OWNED.pop(directory, None)
    if fd is None:
        return
    if now_at is not None:
        with suppress(OSError):
            (now_at / OWNER_LOCK).unlink()
    os.close(fd)


def _owner_alive(directory: Path) -> bool | None:
    """True when a live process holds the owner lock, False when it is free, None without a lock file."""
    if fcntl is None:
        return None
    try:
        fd = os.open(directory / OWNER_LOCK, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # (closing also drops the lock just taken)
    return False


def _stale(entry: Path) -> bool:
    """Unchanged for ``LEFTOVER_AGE_S`` (False for an entry gone meanwhile)."""
    with suppress(OSError):
        return time.time() - entry.stat().st_mtime >= LEFTOVER_AGE_S
    return False


def clear_leftovers(run_dir: Path, echo: Callable[[str], None] = print) -> None:
    """Remove each ``RUN.tmp-<hex>`` a killed replacement of ``run_dir`` left that is an aiayn run without a
    checkpoint, its owner lock free and unchanged for ``LEFTOVER_AGE_S``; name one that holds a checkpoint or
    has no lock with ``rm -r``; leave one whose owner lives or that changed recently."""
    real = run_dir.resolve()  # the sibling sits next to the resolved run (check_replaceable)
    pattern = re.compile(re.escape(real.name) + r"\.tmp-[0-9a-f]{8}")
    try:
        entries = sorted(real.parent.iterdir())
    except OSError:
        return
    entries = _finish_swaps(real, entries, pattern, echo)
    for entry in entries:
        if not pattern.fullmatch(entry.name) or entry.is_symlink() or not entry.is_dir() or entry in _OWNED:
            continue
        alive = _owner_alive(entry)
        if alive or not _stale(entry):  # a live owner, a recent change, or gone meanwhile
            continue
        saved = [p.name for p in (entry / "checkpoints").glob("step-*") if CHECKPOINT_NAME.fullmatch(p.name)]
        marker = read_marker(entry)
        if alive is False and not saved and marker is not None and marker["kind"] == KIND_RUN:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                echo(f"removed {entry}: left by a replacement of {real} (--overwrite) that was stopped "
                     f"before its first checkpoint")
                continue
        what = f"holds {max(saved)} of a replacement (--overwrite) of {real} that" if saved else \
            f"was left by a replacement (--overwrite) of {real} that"
        echo(f"note: {entry} {what} did not finish; remove it with: rm -r {shlex.quote(str(entry))}")


def _finish_swaps(real: Path, entries: list[Path], tmp_pattern: re.Pattern[str],
                  echo: Callable[[str], None]) -> list[Path]:
    """Handle the ``RUN.old-<hex>`` a killed ``swap_in`` left; return the other ``entries``. Killed between
    the renames, the new run is renamed in when unambiguous, else both are named; an old run left is named."""
    def siblings(pattern: re.Pattern[str]) -> list[Path]:
        return [e for e in entries if pattern.fullmatch(e.name) and e.is_dir() and not e.is_symlink()
                and e not in _OWNED]

    olds = [e for e in siblings(re.compile(re.escape(real.name) + r"\.old-[0-9a-f]{8}")) if _stale(e)]
    if not olds:
        return entries
    if real.exists() or real.is_symlink():
        for old in olds if _owner_alive(real) is not True else []:  # (alive: it may be deleting it now)
            echo(f"note: {old} holds the run that a replacement (--overwrite) of {real} replaced; it was "
                 f"stopped before deleting it: remove it with: rm -r {shlex.quote(str(old))}")
        return [e for e in entries if e not in olds]
    news = [e for e in siblings(tmp_pattern) if any(CHECKPOINT_NAME.fullmatch(p.name)
                                                    for p in (e / "checkpoints").glob("step-*"))]
    rest = [e for e in entries if e not in olds and e not in news]
    if any(_owner_alive(e) or not _stale(e) for e in news):
        return rest  # a swap in progress
    if len(olds) == 1 and len(news) == 1 and _owner_alive(news[0]) is False:
        os.rename(news[0], real)
        with suppress(OSError):
            (real / OWNER_LOCK).unlink()
        fsync_dir(real.parent)
        echo(f"finished the replacement (--overwrite) of {real} that was stopped between its two renames: the "
             f"new run ({news[0].name}) is in place; the old one is in {olds[0]}, remove it with: "
             f"rm -r {shlex.quote(str(olds[0]))}")
        return rest
    left = " ".join(shlex.quote(str(e)) for e in [*news, *olds])
    echo(f"note: {real} is missing: a replacement (--overwrite) was stopped between its two renames and left "
         f"{left} (the new run in .tmp-*, the old in .old-*): mv the one to keep to {shlex.quote(str(real))}")
    return rest
