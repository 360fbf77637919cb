"""Where datasets live: ``$AIAYN_DATA_DIR`` or, by default, ``../shared/data``."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "AIAYN_DATA_DIR"


def fetch_hint(dataset: str) -> str:
    """How to get ``dataset`` (a folder under the data root), for a missing-data error."""
    from aiayn.data.fetch import DATASETS

    where = f"set {ENV_VAR} to the folder that holds {dataset}/; the default is ../shared/data"
    if dataset in DATASETS:
        return f"get it with `aiayn fetch {dataset}` (or {where})"
    return where


def data_dir() -> Path:
    """The data root: $AIAYN_DATA_DIR, else ../shared/data from the working directory or the repo."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    repo = Path(__file__).resolve().parents[2]
    for candidate in (Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data"):
        if candidate.is_dir():
            return candidate.resolve()
    return Path("../shared/data")


def dataset_file(*parts: str) -> Path:
    """A file under the data root, or a ``MissingDataError`` (a FileNotFoundError) that says where it
    was looked for, the command that downloads it and how to point elsewhere."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        from aiayn.data.parallel import MissingDataError

        raise MissingDataError(f"dataset file {path} not found; {fetch_hint(parts[0])}")
    return path
