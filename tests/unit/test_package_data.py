"""Every shipped model's file goes into an installed package: pyproject's package-data globs (which
setuptools expands with glob, one folder level per `*`) match every file under aiayn/pretrained,
an ensemble's member folders included (the first globs missed them: a wheel held only the
ensemble's release.json)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_package_data_globs_cover_every_shipped_file() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["aiayn"]
    package = ROOT / "aiayn"
    covered = {path for pattern in patterns for path in package.glob(pattern) if path.is_file()}
    shipped = {path for model in (package / "pretrained").iterdir() if model.is_dir()  # a model's folder
               for path in model.rglob("*") if path.is_file()}
    assert shipped, "aiayn/pretrained ships nothing"
    assert shipped <= covered, sorted(str(p.relative_to(package)) for p in shipped - covered)
