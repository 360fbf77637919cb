"""The data root: where datasets live, ``$AIAYN_DATA_DIR`` or, by default, ``../shared/data``."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "AIAYN_DATA_DIR"


def data_dir() -> Path:
    """The data root: $AIAYN_DATA_DIR, else ../shared/data from the working directory or the repo."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    repo = Path(__file__).resolve().parents[2]
    for candidate in (Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data"):
        if candidate.is_dir():
            return candidate.resolve()
    return Path("../shared/data")
