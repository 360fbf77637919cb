"""A replacement (``--overwrite``) killed during its swap: between renaming the old run away and
the new one in, or before deleting the old one. The next start in that run directory finishes the
swap when that is unambiguous, and otherwise names what is left with the commands; nothing is
deleted (``aiayn.train.leftovers._finish_swaps``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.train import checkpoint as ckpt
from aiayn.train.leftovers import OWNER_LOCK
from aiayn.train.run_dir import clear_leftovers, write_marker

RECIPE = "task: reverse\ntask_options: {n_train: 512, n_val: 32, n_test: 32}\n"
FAST = ["--save-every", "1", "--eval-every", "1000", "--no-progress"]

# ``aiayn train --overwrite`` of ./run that dies (``os._exit``: no cleanup, as when killed) right
# after the swap renamed the old run away, before it renames the new one in.
KILLED_IN_SWAP = f"""
import os
real_rename = os.rename
def rename(source, target):
    real_rename(source, target)
    if ".old-" in os.fspath(target):
        os._exit(9)
os.rename = rename
from aiayn.cli import main
main(["train", "--recipe", "recipe.yaml", "--run-dir", "run", "--overwrite", "--max-steps", "2", *{FAST!r}])
"""


def age(path: Path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tmp dir as the current directory holding a finished 2-step run, ./run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--recipe", "recipe.yaml", "--run-dir", "run", "--max-steps", "2", *FAST])
    assert exit_info.value.code == 0
    return tmp_path


def test_a_swap_killed_between_its_renames_is_finished_by_the_next_start(work, run_aiayn):
    done = subprocess.run([sys.executable, "-c", KILLED_IN_SWAP], cwd=work, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 9, done.stderr
    assert not (work / "run").exists()
    (old,) = work.glob("run.old-*")
    (new,) = work.glob("run.tmp-*")
    assert ckpt.latest_checkpoint(old / "checkpoints").name == "step-00000002"  # the replaced run
    assert ckpt.latest_checkpoint(new / "checkpoints").name == "step-00000001"  # the new one's first
    age(old)
    age(new)
    code, out, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--resume",
                           "--max-steps", "3", *FAST)
    assert code == 0, err
    run = (work / "run").resolve()
    assert (f"finished the replacement (--overwrite) of {run} that was stopped between its two renames: the new "
            f"run ({new.name}) is in place; the old one is in {old.resolve()}, remove it with: "
            f"rm -r {old.resolve()}") in out
    assert not new.exists() and not (run / OWNER_LOCK).exists()
    # The resume continued the new run (its step 1, not the old run's 2), and the old run is intact.
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == \
        ["step-00000001", "step-00000002", "step-00000003"]
    assert ckpt.latest_checkpoint(old / "checkpoints").name == "step-00000002"


def fake_run(path: Path, steps: list[int], lock: bool = False) -> Path:
    for step in steps:
        (path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    path.mkdir(exist_ok=True)
    write_marker(path, "run")
    if lock:
        (path / OWNER_LOCK).write_text("12345\n")  # a lock file nobody holds: its owner is dead
    age(path)
    return path


def test_an_old_run_left_after_a_finished_swap_is_named_not_deleted(tmp_path):
    fake_run(tmp_path / "run", [1])
    old = fake_run(tmp_path / "run.old-0123abcd", [1, 2])
    notes: list[str] = []
    clear_leftovers(tmp_path / "run", notes.append)
    old = old.resolve()
    assert notes == [f"note: {old} holds the run that a replacement (--overwrite) of {(tmp_path / 'run').resolve()} "
                     f"replaced; it was stopped before deleting it: remove it with: rm -r {old}"]
    assert (old / "checkpoints" / "step-00000002").is_dir()


def test_an_ambiguous_killed_swap_is_named_and_nothing_moves(tmp_path):
    """Two new runs with checkpoints (or one without an owner lock file) could each be the one to
    keep: both copies are named, none is renamed or deleted."""
    olds = [fake_run(tmp_path / "run.old-0123abcd", [1, 2])]
    news = [fake_run(tmp_path / "run.tmp-89abcdef", [1], lock=True), fake_run(tmp_path / "run.tmp-feedf00d", [1])]
    before = sorted(p.name for p in tmp_path.iterdir())
    notes: list[str] = []
    clear_leftovers(tmp_path / "run", notes.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert len(notes) == 1 and notes[0].startswith(f"note: {(tmp_path / 'run').resolve()} is missing: a replacement")
    assert all(str(p.resolve()) in notes[0] for p in olds + news)
    shutil.rmtree(news[0])  # one new run left, but it has no owner lock file: still named, not moved
    age(tmp_path)
    notes.clear()
    clear_leftovers(tmp_path / "run", notes.append)
    assert not (tmp_path / "run").exists() and len(notes) == 1 and "is missing" in notes[0]


def test_a_swap_in_progress_is_left_alone(tmp_path):
    """Recent copies (a live process is between its renames, or deleting the old run) are silent."""
    fake_run(tmp_path / "run.old-0123abcd", [1, 2])
    recent = fake_run(tmp_path / "run.tmp-89abcdef", [1], lock=True)
    os.utime(recent)  # changed just now
    notes: list[str] = []
    clear_leftovers(tmp_path / "run", notes.append)
    assert notes == [] and recent.is_dir() and not (tmp_path / "run").exists()
