"""The small files a run directory is known by (its marker ``.aiayn-run``), written so a crash never leaves
half of one."""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

MARKER = ".aiayn-run"
MARKER_VERSION = 1
KIND_RUN, KIND_AVERAGED = "run", "averaged"
CONFIG_FILE = "config.json"
CHECKPOINT_NAME = re.compile(r"step-\d{8}")  # a checkpoint's name: the only entries pruning may delete


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file so that readers see the old or the new content, never part of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_marker(directory: Path, kind: str, **extra: Any) -> None:
    """Mark ``directory`` as aiayn's (a run or averaged checkpoints)."""
    marker = {"kind": kind, "format_version": MARKER_VERSION,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
    atomic_write_text(directory / MARKER, json.dumps(marker, indent=1) + "\n")


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of ``directory``, or None (none, or not aiayn's JSON)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("kind"), str) else None
