"""Run directories know they are one: ``--overwrite`` deletes only an aiayn run (never a folder of
other files, the current directory, its parents or the home directory), replaces it only once the
new run has a checkpoint, and ``average`` never writes into a run's checkpoints/ or over a folder it
did not create. Each refusal is one line, exit code 2, and leaves every file as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

from aiayn.cli import main
from aiayn.tasks.reverse import ReverseTask
from aiayn.train import checkpoint as ckpt
from aiayn.train import leftovers as leftovers_module
from aiayn.train.leftovers import OWNER_LOCK
from aiayn.train.run_dir import (
    MARKER,
    RunDirError,
    claim_output_dir,
    clear_leftovers,
    is_run_dir,
    prepare_run_dir,
    write_marker,
)

OLD_RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs"
# A small reverse task (through a recipe: the CLI has no option for the split sizes), 2 steps.
RECIPE = "task: reverse\ntask_options: {n_train: 512, n_val: 32, n_test: 32}\n"
FAST = ["--max-steps", "2", "--save-every", "1", "--eval-every", "1000", "--no-progress"]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative name -> (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-step run (checkpoints 1 and 2), copied by the tests that need one."""
    root = tmp_path_factory.mktemp("trained")
    (root / "recipe.yaml").write_text(RECIPE)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--recipe", str(root / "recipe.yaml"), "--run-dir", str(root / "run"), *FAST])
    assert exit_info.value.code == 0
    return root / "run"


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained: Path) -> Path:
    """A tmp dir as the current directory, with the recipe and a copy of the trained run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    return tmp_path


def siblings(path: Path) -> list[str]:
    """Temporary or old copies left next to a run (``run.tmp-*``, ``run.old-*``)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f"{path.name}."))


# ---- --overwrite deletes only a run -----------------------------------------------------------
def test_overwrite_refuses_a_folder_of_unrelated_files(work, run_aiayn):
    junk = work / "thesis"
    junk.mkdir()
    (junk / "chapter1.tex").write_text("\\section{Introduction}\n")
    (junk / "config.json").write_text('{"theme": "dark"}')  # a config.json, but not an aiayn run's
    before = snapshot(work)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "thesis", "--overwrite", *FAST)
    assert code == 2
    assert "refusing to overwrite thesis: it is not an aiayn run directory" in err
    assert "choose another --run-dir" in err
    assert snapshot(work) == before


@pytest.mark.parametrize("target", [".", "./", "sub/.."])
def test_overwrite_refuses_the_current_directory(work, run_aiayn, target):
    (work / "sub").mkdir()
    before = snapshot(work)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", target, "--overwrite", *FAST)
    assert code == 2
    assert f"({work.resolve()}): it is the current directory, not a run directory" in err
    assert snapshot(work) == before


def test_overwrite_refuses_a_parent_of_the_current_directory(work, run_aiayn, monkeypatch):
    inner = work / "a" / "b"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    before = snapshot(work)
    for target in ("..", "../..", str(work)):
        code, _, err = run_aiayn("train", "--recipe", str(work / "recipe.yaml"), "--run-dir", target,
                             "--overwrite", *FAST)
        assert code == 2
        assert "it is a parent of the current directory, not a run directory" in err
    assert snapshot(work) == before


def test_overwrite_refuses_a_symlink_to_the_current_directory(work, run_aiayn):
    (work / "here").symlink_to(work, target_is_directory=True)
    before = snapshot(work)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "here", "--overwrite", *FAST)
    assert code == 2
    assert "refusing to overwrite here" in err and "it is the current directory" in err
    assert snapshot(work) == before


def test_overwrite_refuses_home_and_root(work, run_aiayn, monkeypatch):
    home = work / "home"
    (home / "documents").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(work)
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", str(home), "--overwrite", *FAST)
    assert code == 2 and "it is your home directory, not a run directory" in err
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "~", "--overwrite", *FAST)
    assert code == 2 and "'~' is not expanded here" in err
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "/", "--overwrite", *FAST)
    assert code == 2 and "it is the filesystem root" in err
    assert snapshot(work) == before


def test_overwrite_with_a_typo_in_the_task_keeps_the_old_run(work, run_aiayn):
    run = work / "run"
    before = snapshot(work)
    code, _, err = run_aiayn("train", "--task", "revrese", "--run-dir", "run", "--overwrite", *FAST)
    assert code == 2 and "unknown task 'revrese' (did you mean reverse?); known tasks:" in err
    code, _, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--overwrite",
                         "--d-model", "30", "--n-heads", "4", *FAST)
    assert code == 2 and "d_model=30 is not divisible by n_heads=4" in err
    assert snapshot(work) == before
    assert ckpt.latest_checkpoint(run / "checkpoints").name == "step-00000002"
    assert siblings(run) == []


def test_overwrite_that_fails_before_its_first_checkpoint_keeps_the_old_run(work, capsys, monkeypatch):
    """A failure after the new run was started (here: building its model) removes the temporary
    sibling and leaves the old run as it was."""
    run = work / "run"
    before = snapshot(work)
    started: list[Path] = []

    def broken(self: ReverseTask, config: object) -> nn.Module:
        started.append(self.run_dir)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(ReverseTask, "build_model", broken)
    with pytest.raises(SystemExit) as info:
        main(["train", "--recipe", "recipe.yaml", "--run-dir", "run", "--overwrite", *FAST])
    assert info.value.code == 1  # an unforeseen failure: aiayn.cli.main's last-resort line
    assert "internal error: RuntimeError: out of memory (simulated)" in capsys.readouterr().err
    assert started and started[0].name.startswith("run.tmp-")  # the new run lived in a sibling
    assert not started[0].exists() and siblings(run) == []
    assert snapshot(work) == before


def test_overwrite_of_a_run_replaces_it(work, run_aiayn):
    run = work / "run"
    code, out, _ = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--overwrite",
                         "--max-steps", "3", "--save-every", "3", "--eval-every", "1000", "--no-progress")
    assert code == 0, out
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step-00000003"]
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 3
    assert json.loads((run / MARKER).read_text())["kind"] == "run"
    for name in ("metrics.csv", "summary.json", "curves.png"):  # written after the swap, in place
        assert (run / name).is_file(), name
    assert siblings(run) == []


def test_new_run_in_an_empty_or_missing_folder_gets_a_marker(work, run_aiayn):
    (work / "empty").mkdir()
    for name in ("empty", "deep/new"):
        code, _, _ = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", name, *FAST)
        assert code == 0
        assert json.loads((work / name / MARKER).read_text())["kind"] == "run"
        assert siblings(work / name) == []


def test_old_run_without_marker_is_a_run_and_gets_one_on_resume(tmp_path, run_aiayn, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = Path(shutil.copytree(OLD_RUNS / "reverse", tmp_path / "old"))
    assert not (old / MARKER).exists() and is_run_dir(old)
    code, out, _ = run_aiayn("train", "--resume", "--run-dir", "old", "--max-steps", "4", "--no-progress")
    assert code == 0 and "resuming" in out
    assert json.loads((old / MARKER).read_text())["kind"] == "run"


def test_resume_of_a_broken_config_is_one_line(work, run_aiayn):
    (work / "run" / "config.json").write_text("{not json")
    code, _, err = run_aiayn("train", "--resume", "--run-dir", "run", "--no-progress")
    assert code == 2 and "config.json cannot be read as JSON" in err


# ---- average writes only where it may -----------------------------------------------------------
def test_average_refuses_the_runs_checkpoints_and_resume_still_works(work, run_aiayn):
    before = snapshot(work)
    for out in ("run/checkpoints", "run/checkpoints/averaged", "run"):
        code, _, err = run_aiayn("average", "--run", "run", "--last", "2", "--out", out)
        assert code == 2, out
        assert f"refusing to write into {out}:" in err
    assert snapshot(work) == before
    code, out, _ = run_aiayn("train", "--resume", "--run-dir", "run", "--max-steps", "3", "--no-progress")
    assert code == 0 and "resuming" in out and "(step 2," in out


def test_average_refuses_a_folder_it_did_not_create(work, run_aiayn):
    photos = work / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    before = snapshot(work)
    code, _, err = run_aiayn("average", "--run", "run", "--last", "2", "--out", "photos")
    assert code == 2
    assert "refusing to write into photos: it is not empty and aiayn did not create it" in err
    assert snapshot(work) == before


def test_average_may_write_again_into_its_own_output(work, run_aiayn):
    for _ in range(2):
        code, out, _ = run_aiayn("average", "--run", "run", "--last", "2", "--out", "avg")
        assert code == 0 and "averaged step-00000001, step-00000002 -> avg" in out
    assert json.loads((work / "avg" / MARKER).read_text())["kind"] == "averaged"
    assert [p.name for p in ckpt.list_checkpoints(work / "avg")] == ["step-00000002"]


# ---- checkpoint folders: pruning and the latest pointer -----------------------------------------
def _save(directory: Path, step: int, model: nn.Module, keep: int = 2) -> None:
    ckpt.save_checkpoint(directory, step=step, model=model, optimizer=None, keep=keep,
                         state={"epoch": 0, "batch_in_epoch": 0})


def test_pruning_deletes_only_checkpoints_it_wrote(tmp_path):
    model = nn.Linear(2, 2)
    directory = tmp_path / "checkpoints"
    users = directory / "step-00000000"  # a folder named like a checkpoint, holding a user's file
    users.mkdir(parents=True)
    (users / "state.json").write_text("{}")
    (users / "notes.txt").write_text("keep me")
    other = directory / "step-1-mine"
    other.mkdir()
    for step in (1, 2, 3):
        _save(directory, step, model)
    assert (users / "notes.txt").read_text() == "keep me" and other.is_dir()
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-00000000", "step-00000002",
                                                           "step-00000003", "step-1-mine"]


def test_latest_pointer_cannot_leave_its_folder(tmp_path):
    model = nn.Linear(2, 2)
    outside = tmp_path / "elsewhere"
    _save(outside, 7, model)
    directory = tmp_path / "run" / "checkpoints"
    _save(directory, 1, model)
    (directory / "latest").write_text("../../elsewhere/step-00000007\n")
    assert ckpt.latest_checkpoint(directory) == directory / "step-00000001"


def test_claim_output_dir_rules(tmp_path):
    model = nn.Linear(2, 2)
    checkpoints = tmp_path / "plain" / "checkpoints"  # checkpoints outside any run: still not empty
    _save(checkpoints, 1, model)
    with pytest.raises(RunDirError, match="it is not empty and aiayn did not create it"):
        ckpt.average_last_checkpoints(checkpoints, 1, model, checkpoints)
    assert [p.name for p in ckpt.list_checkpoints(checkpoints)] == ["step-00000001"]
    with pytest.raises(RunDirError, match="it is a file"):
        (tmp_path / "file").write_text("x")
        claim_output_dir(tmp_path / "file")
    saved = ckpt.average_last_checkpoints(checkpoints, 1, model, tmp_path / "avg")
    assert saved == tmp_path / "avg" / "step-00000001" and (tmp_path / "avg" / MARKER).is_file()


# ---- what a killed --overwrite leaves behind ----------------------------------------------------
# A process that starts a replacement of ./run (``--overwrite``: the new run is written in a
# temporary sibling, run.tmp-<hex>), prints its name and dies (``os._exit``: no cleanup, as when
# killed).
KILLED_REPLACEMENT = """
import os
from pathlib import Path
from aiayn.train.run_dir import prepare_run_dir
location = prepare_run_dir(Path("run"), {"task": "reverse"}, resume=False, overwrite=True, echo=lambda line: None)
print(location.path.name, flush=True)
os._exit(9)
"""


def age(path: Path, seconds: float = 3600) -> None:
    """Make ``path`` look unchanged for ``seconds`` (the rule leaves a recent sibling alone)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_killed_overwrites_sibling_is_removed_when_the_run_is_used_again(work, run_aiayn):
    """A replacement killed before its first checkpoint left run.tmp-<hex>; the next start in that
    run directory (here a resume) removes it, says so, and leaves alone the sibling of a replacement
    whose process still holds its lock (started here, its lock handed over as if another process's)."""
    done = subprocess.run([sys.executable, "-c", KILLED_REPLACEMENT], cwd=work, capture_output=True, text=True,
                          timeout=120)
    killed = work / done.stdout.strip()
    assert done.returncode == 9 and killed.is_dir() and killed.name.startswith("run.tmp-"), done.stderr
    live = prepare_run_dir(work / "run", {"task": "reverse"}, resume=False, overwrite=True).path
    lock = leftovers_module._OWNED.pop(live)  # still locked: a live owner that is not this start
    try:
        age(killed)
        age(live)
        live_before = snapshot(live)
        code, out, err = run_aiayn("train", "--recipe", "recipe.yaml", "--run-dir", "run", "--resume",
                               "--max-steps", "3", "--save-every", "1", "--eval-every", "1000", "--no-progress")
        assert code == 0, err
        assert f"removed {killed.resolve()}: left by a replacement of {(work / 'run').resolve()} (--overwrite) " \
               f"that was stopped before its first checkpoint" in out
        assert not killed.exists()
        assert snapshot(live) == live_before and live.name not in out  # its owner lives: untouched
        assert ckpt.latest_checkpoint(work / "run" / "checkpoints").name == "step-00000003"
    finally:
        os.close(lock)


def test_leftovers_that_are_not_clearly_dead_are_named_not_removed(tmp_path):
    """The rule's other cases: a sibling holding a checkpoint, or without an owner lock (an older
    aiayn's), is named with the command that removes it; a recent one is left alone, silently."""
    (tmp_path / "run").mkdir()
    with_checkpoint = tmp_path / "run.tmp-0123abcd"
    (with_checkpoint / "checkpoints" / "step-00000004").mkdir(parents=True)
    (with_checkpoint / OWNER_LOCK).write_text("12345\n")  # a lock file nobody holds
    write_marker(with_checkpoint, "run")
    unlocked = tmp_path / "run.tmp-89abcdef"
    unlocked.mkdir()
    write_marker(unlocked, "run")
    recent = tmp_path / "run.tmp-feedf00d"
    recent.mkdir()
    (recent / OWNER_LOCK).write_text("")
    not_ours = tmp_path / "run.tmp-notahexname"
    not_ours.mkdir()
    for path in (with_checkpoint, unlocked, not_ours):
        age(path)
    before = snapshot(tmp_path)
    notes: list[str] = []
    clear_leftovers(tmp_path / "run", notes.append)
    assert snapshot(tmp_path) == before
    run, with_checkpoint, unlocked = (p.resolve() for p in (tmp_path / "run", with_checkpoint, unlocked))
    assert notes == [f"note: {with_checkpoint} holds step-00000004 of a replacement (--overwrite) of {run} "
                     f"that did not finish; remove it with: rm -r {with_checkpoint}",
                     f"note: {unlocked} was left by a replacement (--overwrite) of {run} that did not "
                     f"finish; remove it with: rm -r {unlocked}"]
