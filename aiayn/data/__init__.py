"""Where datasets live: ``$AIAYN_DATA_DIR`` or, by default, ``../shared/data``."""

from __future__ import annotations

from pathlib import Path

from aiayn.data.root import ENV_VAR, data_dir

__all__ = ["ENV_VAR", "data_dir", "dataset_file", "fetch_hint"]


def fetch_hint(dataset: str) -> str:
    """How to get ``dataset`` (a folder under the data root), for a missing-data error."""
    from aiayn.data.fetch import DATASETS

    where = f"set {ENV_VAR} to the folder that holds {dataset}/; the default is ../shared/data"
    return f"get it with `aiayn fetch {dataset}` (or {where})" if dataset in DATASETS else where


def dataset_file(*parts: str) -> Path:
    """A file under the data root, or a ``MissingDataError`` naming where and how to fetch it."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        from aiayn.data.parallel import MissingDataError

        raise MissingDataError(f"dataset file {path} not found; {fetch_hint(parts[0])}")
    return path
