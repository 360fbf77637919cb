"""``aiayn fetch DATASET``: files pinned to a commit, written to a temporary name, SHA-256 checked, then
renamed into place; a present file is skipped when it verifies and never written over. ``$AIAYN_DATA_URL``
names a mirror."""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from aiayn.data.root import data_dir

URL_ENV_VAR = "AIAYN_DATA_URL"
TIMEOUT_S = 60.0  # per connection and per read: a stalled server fails, it never hangs


class FetchError(OSError):
    """A download that failed or did not verify (an I/O failure: the CLI exits 1, one line)."""


@dataclass(frozen=True)
class Remote:
    """One file of a dataset: its name at the source, its SHA-256 and whether it is served gzipped."""

    name: str
    sha256: str
    gzipped: bool = False


@dataclass(frozen=True)
class Dataset:
    about: str
    base_url: str  # the public source (a commit-pinned raw URL)
    files: Mapping[str, Remote] = field(default_factory=dict)  # local name -> where it comes from
    used_by: str = ""


# Pinned to the commits of ../shared/data/*/README.md: a moving branch could change the bytes.
MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
CHAR_RNN_COMMIT = "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e"

DATASETS: dict[str, Dataset] = {
    "multi30k": Dataset(
        about="Multi30k task 1, English-German captions: train / val / test2016 (.en, .de)",
        base_url=f"https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}/data/task1/raw",
        files={
            "train.en": Remote("train.en.gz", "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6", True),
            "train.de": Remote("train.de.gz", "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72", True),
            "val.en": Remote("val.en.gz", "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227", True),
            "val.de": Remote("val.de.gz", "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660", True),
            "test2016.en": Remote("test_2016_flickr.en.gz",
                                  "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182", True),
            "test2016.de": Remote("test_2016_flickr.de.gz",
                                  "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16", True),
        },
        used_by="the translation task (recipes/multi30k-*.yaml)",
    ),
    "tinyshakespeare": Dataset(
        about="Tiny Shakespeare, 1.1 MB of plays (Karpathy's char-rnn): input.txt",
        base_url=f"https://raw.githubusercontent.com/karpathy/char-rnn/{CHAR_RNN_COMMIT}/data/tinyshakespeare",
        files={"input.txt": Remote("input.txt", "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")},
        used_by="the shakespeare-* language-model tasks",
    ),
}


def sha256_of(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def missing_files(dataset: Dataset, folder: Path) -> list[str]:
    """The dataset's files not present in ``folder`` (present ones are not hashed: a listing)."""
    return [name for name in dataset.files if not (folder / name).is_file()]


def fetch_files(folder: Path, files: Mapping[str, tuple[str, str, bool]], *, timeout: float = TIMEOUT_S,
                echo: Callable[[str], None] | None = None) -> list[str]:
    """Download ``files`` (local name -> (url, sha256, gzipped)) into ``folder``; the names fetched. Any
    failure is a one-line FetchError."""
    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # what mkdir creates, deepest first
    fetched: list[str] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, (url, sha256, gzipped) in files.items():
            target = folder / name
            if target.exists():
                if target.is_file() and sha256_of(target) == sha256:
                    continue
                raise FetchError(f"{target} exists but is not the expected file (SHA-256 differs); "
                                 f"move it away and fetch again")
            if echo is not None:
                echo(f"fetching {url} -> {target}")
            _download(url, target, sha256, gzipped=gzipped, timeout=timeout)
            fetched.append(name)
    except OSError as exc:
        for created in made:  # the folders this call made, if still empty (rmdir refuses otherwise)
            with suppress(OSError):
                created.rmdir()
        if isinstance(exc, FetchError):
            raise
        raise FetchError(f"cannot write {exc.filename or folder}: {exc.strerror or exc}") from None
    return fetched


def _download(url: str, target: Path, sha256: str, *, gzipped: bool, timeout: float) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
                source = gzip.GzipFile(fileobj=response) if gzipped else response
                for chunk in iter(lambda: source.read(1 << 20), b""):
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except (OSError, EOFError, zlib.error) as exc:  # URLError, HTTPError, timeouts, a broken gzip stream
            reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
            raise FetchError(f"cannot download {target.name} from {url}: {reason}; check the network "
                             f"(or a mirror in ${URL_ENV_VAR}), or put the file there by hand") from None
        if digest.hexdigest() != sha256:
            raise FetchError(f"{target.name} from {url} is not the expected file (SHA-256 "
                             f"{digest.hexdigest()[:16]}..., expected {sha256[:16]}...); nothing was kept")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def dataset_sources(name: str) -> dict[str, tuple[str, str, bool]]:
    """Local name -> (url, sha256, gzipped) for the files of dataset ``name``, from its source or a mirror."""
    base = os.environ.get(URL_ENV_VAR)
    root = f"{base.rstrip('/')}/{name}" if base else DATASETS[name].base_url
    return {local: (f"{root}/{remote.name}", remote.sha256, remote.gzipped)
            for local, remote in DATASETS[name].files.items()}


def fetch_dataset(name: str, data_root: Path | None = None, *,
                  echo: Callable[[str], None] | None = None) -> tuple[Path, list[str]]:
    """Fetch dataset ``name`` into ``data_root/name``; returns (its folder, the files downloaded now)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (`aiayn fetch` lists them)")
    folder = Path(data_root if data_root is not None else data_dir()) / name
    return folder, fetch_files(folder, dataset_sources(name), echo=echo)
