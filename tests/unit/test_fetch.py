"""``aiayn fetch``: downloads from a local HTTP server (127.0.0.1, never the network), checked by
SHA-256, written atomically, skipped when already verified; every failure one line, nothing left."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.data.fetch import DATASETS, FetchError, fetch_files, sha256_of

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours http_proxy: the local server must be reached directly, whatever the machine's."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "127.0.0.1,localhost")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # no request lines in the test output
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str, list[str]]]:
    """(folder served, its base URL, the paths requested) on 127.0.0.1, a free port, shut down after."""
    root = tmp_path / "served"
    root.mkdir()
    requested: list[str] = []

    class Handler(_QuietHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}", requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _fake(root: Path, name: str, text: bytes, *, gzipped: bool = False) -> str:
    """Serve ``text`` as ``name`` (gzipped if asked); its SHA-256 (of the plain bytes)."""
    (root / name).write_bytes(gzip.compress(text) if gzipped else text)
    return hashlib.sha256(text).hexdigest()


def _files(url: str, names: dict[str, tuple[str, bool]]) -> dict[str, tuple[str, str, bool]]:
    return {name: (f"{url}/{name}" + (".gz" if gz else ""), sha, gz) for name, (sha, gz) in names.items()}


def test_files_land_verify_and_are_skipped_when_there(served, tmp_path):
    root, url, requested = served
    plain = _fake(root, "a.txt", b"first line\nzweite Zeile\n")
    packed = _fake(root, "b.de.gz", "Straße\n".encode(), gzipped=True)
    files = _files(url, {"a.txt": (plain, False), "b.de": (packed, True)})
    out = tmp_path / "data" / "fake"
    assert fetch_files(out, files, timeout=10) == ["a.txt", "b.de"]
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.de"]  # no temporary file left
    assert (out / "b.de").read_text(encoding="utf-8") == "Straße\n"  # gunzipped
    assert sha256_of(out / "a.txt") == plain
    assert len(requested) == 2
    assert fetch_files(out, files, timeout=10) == []  # both verified: nothing downloaded again
    assert len(requested) == 2


def test_a_corrupted_file_is_refused_and_nothing_is_left(served, tmp_path):
    root, url, _ = served
    good = _fake(root, "good.txt", b"good\n")
    expected = hashlib.sha256(b"the bytes we expect\n").hexdigest()
    _fake(root, "bad.txt", b"other bytes\n")
    out = tmp_path / "new" / "fake"
    with pytest.raises(FetchError) as caught:
        fetch_files(out, _files(url, {"bad.txt": (expected, False), "good.txt": (good, False)}), timeout=10)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("bad.txt from ") and "not the expected file" in message
    assert not (tmp_path / "new").exists()  # no file, no temporary, not even the folders it made


def test_an_existing_file_that_does_not_verify_is_never_written_over(served, tmp_path):
    root, url, requested = served
    sha = _fake(root, "a.txt", b"served\n")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "a.txt").write_bytes(b"the user's own corpus\n")
    with pytest.raises(FetchError, match=r"a\.txt exists but is not the expected file"):
        fetch_files(out, _files(url, {"a.txt": (sha, False)}), timeout=10)
    assert (out / "a.txt").read_bytes() == b"the user's own corpus\n" and requested == []


def test_an_unreachable_server_is_one_line_soon(tmp_path):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(FetchError) as caught:
        fetch_files(tmp_path / "x", {"a.txt": (f"http://127.0.0.1:{port}/a.txt", "0" * 64, False)}, timeout=5)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot download a.txt from http://127.0.0.1:{port}/a.txt")
    assert not (tmp_path / "x").exists()


def test_the_checksums_are_those_of_the_shared_copies():
    """The constants match the dataset copies the tasks were developed on (where they are here)."""
    checked = 0
    for name, dataset in DATASETS.items():
        for local, remote in dataset.files.items():
            path = SHARED / name / local
            if path.is_file():
                assert sha256_of(path) == remote.sha256, path
                checked += 1
    if not checked:
        pytest.skip(f"no dataset copies in {SHARED}")


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return exit_info.value.code or 0, captured.out, captured.err


def test_cli_fetch_through_a_mirror_with_the_real_checksums(served, tmp_path, capsys, monkeypatch):
    """`aiayn fetch tinyshakespeare` from $AIAYN_DATA_URL (the shared copy served locally, so the real
    constant is checked) into --data-dir; again: skipped; the listing says it is there."""
    source = SHARED / "tinyshakespeare" / "input.txt"
    if not source.is_file():
        pytest.skip(f"no {source}")
    root, url, requested = served
    (root / "tinyshakespeare").mkdir()
    (root / "tinyshakespeare" / "input.txt").write_bytes(source.read_bytes())
    monkeypatch.setenv("AIAYN_DATA_URL", url)
    data = tmp_path / "data"
    code, out, _ = _cli(capsys, "fetch", "tinyshakespeare", "--data-dir", str(data))
    assert code == 0 and "1 file(s) downloaded and verified" in out
    assert sha256_of(data / "tinyshakespeare" / "input.txt") == DATASETS["tinyshakespeare"].files["input.txt"].sha256
    code, out, _ = _cli(capsys, "fetch", "tinyshakespeare", "--data-dir", str(data))
    assert code == 0 and "0 file(s) downloaded and verified, 1 already there and verified" in out
    assert requested == ["/tinyshakespeare/input.txt"]
    code, out, _ = _cli(capsys, "fetch", "--data-dir", str(data))
    assert code == 0
    assert "tinyshakespeare" in out and "[present]" in out and "multi30k" in out and "missing 6 of 6" in out


def test_cli_fetch_multi30k_goes_where_the_task_reads(served, tmp_path, capsys, monkeypatch):
    """Gzipped fake files with the real names; the real checksums refuse them: exit 1, one line
    naming the file, nothing in the data root. With the task's data root as AIAYN_DATA_DIR and no
    --data-dir, the folder is <data root>/multi30k, the translation task's default corpus."""
    from aiayn.tasks.translation import TranslationTask

    root, url, _ = served
    (root / "multi30k").mkdir()
    for remote in DATASETS["multi30k"].files.values():
        _fake(root / "multi30k", remote.name, b"fake\n", gzipped=True)
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("AIAYN_DATA_URL", url)
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data))
    code, _, err = _cli(capsys, "fetch", "multi30k")
    assert code == 1
    error = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "train.en from " in error[0] and "not the expected file" in error[0], err
    assert list(data.iterdir()) == []
    if not (SHARED / "multi30k" / "train.en").is_file():
        pytest.skip(f"no Multi30k copy in {SHARED}")
    for local, remote in DATASETS["multi30k"].files.items():  # now the real bytes: accepted
        (root / "multi30k" / remote.name).write_bytes(
            gzip.compress((SHARED / "multi30k" / local).read_bytes(), compresslevel=1))
    code, out, _ = _cli(capsys, "fetch", "multi30k")
    assert code == 0 and "6 file(s) downloaded and verified" in out
    assert TranslationTask().root() == data / "multi30k"
    assert sorted(p.name for p in (data / "multi30k").iterdir()) == sorted(DATASETS["multi30k"].files)


def test_the_old_command_name_still_works(served, tmp_path, capsys, monkeypatch):
    """`aiayn fetch-multi30k --to DIR` (hidden now) still runs, checked the same way; --to is the
    corpus folder itself."""
    code, out, _ = _cli(capsys, "--help")
    assert code == 0 and "fetch-multi30k" not in out and "fetch " in out
    root, url, requested = served
    (root / "multi30k").mkdir()
    for remote in DATASETS["multi30k"].files.values():
        _fake(root / "multi30k", remote.name, b"fake\n", gzipped=True)
    monkeypatch.setenv("AIAYN_DATA_URL", url)
    code, _, err = _cli(capsys, "fetch-multi30k", "--to", str(tmp_path / "corpus"))
    assert code == 1 and err.count("\n") == 1 and "train.en from" in err and "not the expected file" in err
    assert requested == ["/multi30k/train.en.gz"] and not (tmp_path / "corpus").exists()
