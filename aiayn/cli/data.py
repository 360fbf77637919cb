"""``aiayn fetch``: the datasets the tasks read, downloaded and checked (``aiayn.data.fetch``)."""

from __future__ import annotations

from pathlib import Path

import click

from aiayn.cli.app import cli
from aiayn.data.fetch import DATASETS  # no torch: cheap at start-up


@cli.command("fetch")
@click.argument("dataset", required=False,
                type=click.Choice(list(DATASETS), case_sensitive=False))
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The data root to fill (the dataset goes in DATA_DIR/DATASET).  [default: "
                   "$AIAYN_DATA_DIR, else ../shared/data: where the tasks read it]")
def fetch_cmd(dataset: str | None, data_dir: Path | None) -> None:
    """Download DATASET from its public source into the data root, where the tasks read it; without
    DATASET, list the datasets and whether they are there.

    Each file's SHA-256 is checked before it is renamed into place: a failed or mismatching download
    leaves nothing behind, and files already there and verified are skipped. With --data-dir
    elsewhere, point the tasks at it with AIAYN_DATA_DIR=DATA_DIR. A mirror: AIAYN_DATA_URL=URL reads
    URL/DATASET/FILE instead.
    """
    from aiayn.data import data_dir as default_root
    from aiayn.data.fetch import fetch_dataset, missing_files

    root = data_dir if data_dir is not None else default_root()
    if dataset is None:
        click.echo(f"datasets (`aiayn fetch DATASET` puts them in {root}/DATASET):")
        for name, info in DATASETS.items():
            missing = missing_files(info, root / name)
            state = "present" if not missing else f"missing {len(missing)} of {len(info.files)} files"
            click.echo(f"  {name:<16} {info.about}; for {info.used_by} [{state}]")
        return
    name = dataset.lower()
    folder, fetched = fetch_dataset(name, root, echo=lambda line: click.echo(line, err=True))
    kept = len(DATASETS[name].files) - len(fetched)
    click.echo(f"{name} in {folder}: {len(fetched)} file(s) downloaded and verified"
               + (f", {kept} already there and verified" if kept else ""))
