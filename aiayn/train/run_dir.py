"""Run directories that know they are one (their ``.aiayn-run`` marker, or an older run's config.json), and
the only ways aiayn creates, replaces or writes into a directory: nothing it did not create is deleted or
written over. ``--overwrite`` starts the new run in a sibling, ``RUN.tmp-<random>``, swapped in after its
first checkpoint; a failure before that leaves the old run as it was."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.config import ModelConfig, TrainConfig
from aiayn.train.leftovers import _disown, _own, clear_leftovers
from aiayn.train.run_files import (
    CHECKPOINT_NAME,
    CONFIG_FILE,
    KIND_AVERAGED,
    KIND_RUN,
    MARKER,
    atomic_write_text,
    fsync_dir,
    read_marker,
    write_marker,
)


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (exists, differs, missing, not aiayn's)."""


def read_run_config(run_dir: Path, *, hint: str = "train one with aiayn train") -> dict[str, Any]:
    """A run's ``config.json``, checked for shape; a RunDirError otherwise."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); {hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunDirError(f"{path} cannot be read as JSON ({exc}); is {run_dir} an aiayn run?") from None
    shape_ok = (isinstance(data, dict) and isinstance(data.get("task"), str)
                and isinstance(data.get("model"), dict) and isinstance(data.get("train"), dict)
                and isinstance(data.get("task_options", {}), dict))
    if not shape_ok:
        raise RunDirError(f"{path} is not an aiayn run config (a mapping with task, task_options, model "
                          f"and train); is {run_dir} an aiayn run?")
    return data


def is_run_dir(directory: Path) -> bool:
    """A run aiayn wrote, by its marker or (older runs) its config.json."""
    marker = read_marker(directory)
    if marker is not None:
        return marker["kind"] == KIND_RUN
    try:
        read_run_config(directory)
    except RunDirError:
        return False
    return True


def is_averaged_dir(directory: Path) -> bool:
    """Averaged checkpoints aiayn wrote, by its marker or (older) holding only averaged checkpoints."""
    marker = read_marker(directory)
    if marker is not None:
        return marker["kind"] == KIND_AVERAGED
    entries = list(directory.iterdir())
    checkpoints = [p for p in entries if CHECKPOINT_NAME.fullmatch(p.name)]
    others = [p for p in entries if p not in checkpoints and p.name != "latest" and not p.name.startswith(".tmp-step-")]
    if not checkpoints or others:
        return False
    for path in checkpoints:
        try:
            if "averaged" not in json.loads((path / "state.json").read_text(encoding="utf-8")):
                return False
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            return False
    return True


def _what_it_is(real: Path) -> str | None:
    """Why ``real`` (a resolved path) must never be deleted, or None."""
    cwd = Path.cwd().resolve()
    home = None
    with suppress(RuntimeError, KeyError):  # no HOME and no passwd entry
        home = Path.home().resolve()
    named = ((Path(real.anchor), "the filesystem root"), (home, "your home directory"),
             (cwd, "the current directory"))
    return next((what for path, what in named if real == path),
                "a parent of the current directory" if real in cwd.parents else None)


def check_replaceable(run_dir: Path) -> Path:
    """The real path of a run ``--overwrite`` may replace (an aiayn run, never the root, home, the current
    directory or its parents), or a RunDirError."""
    real = run_dir.resolve()
    what = _what_it_is(real)
    if what is not None:
        shown = f"{run_dir} ({real})" if str(run_dir) != str(real) else str(run_dir)
        raise RunDirError(f"refusing to overwrite {shown}: it is {what}, not a run directory; "
                          f"give --run-dir the run's own folder")
    if not is_run_dir(real):
        raise RunDirError(f"refusing to overwrite {run_dir}: it is not an aiayn run directory (no {MARKER} "
                          f"and no aiayn {CONFIG_FILE}), so its files are not aiayn's to delete; choose "
                          f"another --run-dir, or move those files away yourself")
    return real


def claim_output_dir(out_dir: Path, *, kind: str = KIND_AVERAGED, **extra: Any) -> None:
    """Make ``out_dir`` ready for aiayn to write ``kind`` into, or refuse with a RunDirError (inside a run, a
    run, a non-empty directory aiayn did not create as ``kind``)."""
    real = out_dir.resolve()
    for folder in (real, *real.parents):
        if folder.name == "checkpoints" and is_run_dir(folder.parent):
            raise RunDirError(f"refusing to write into {out_dir}: it is in the checkpoints/ of the run "
                              f"{folder.parent}, which training resumes from and prunes; choose an --out "
                              f"outside it, such as {folder.parent / 'averaged'}")
    if real.exists() and not real.is_dir():
        raise RunDirError(f"refusing to write into {out_dir}: it is a file; choose a directory")
    if real.is_dir() and any(real.iterdir()):
        if is_run_dir(real):
            raise RunDirError(f"refusing to write into {out_dir}: it is a run directory; choose a new "
                              f"directory for the output")
        marker = read_marker(real)
        ours = marker["kind"] == kind if marker is not None else kind == KIND_AVERAGED and is_averaged_dir(real)
        if not ours:
            raise RunDirError(f"refusing to write into {out_dir}: it is not empty and aiayn did not create "
                              f"it for {kind} checkpoints; choose a new or empty directory")
    try:
        real.mkdir(parents=True, exist_ok=True)
        if read_marker(real) is None:
            write_marker(real, kind, **extra)
    except OSError as exc:
        raise RunDirError(f"cannot write {out_dir}: {exc.strerror or exc}") from None


@dataclass
class RunLocation:
    """Where a run is written (``path``) and ends up (``final``; a replacement's differ until ``swap_in``)."""

    final: Path
    path: Path
    fresh: bool = False  # a new run in a missing or empty folder, this start's until its first checkpoint
    made: tuple[Path, ...] = ()  # the folders this start created, deepest first

    @property
    def pending(self) -> bool:
        """True while the run lives in its temporary sibling."""
        return self.path != self.final

    def nothing_saved(self) -> str:
        """What became of the run directory when a start ends before its first checkpoint."""
        if self.pending:
            return f"no checkpoint had been saved, and the run it was to replace, {self.final}, is untouched"
        if self.fresh:  # abandon() empties it: the same command can start again
            return f"no checkpoint had been saved, so {self.final} was left as it was before this start"
        return "no checkpoint had been saved"

    def swap_in(self) -> None:
        """Rename the old run away, the new one in, then delete the old (put back on a failure between)."""
        self.fresh = False  # it holds a checkpoint now: a run to resume, never removed
        if not self.pending:
            return
        old = self.final.with_name(f"{self.final.name}.old-{secrets.token_hex(4)}")
        had_old = self.final.exists()
        if had_old:
            os.rename(self.final, old)
        try:
            os.rename(self.path, self.final)
        except BaseException:
            if had_old:
                os.rename(old, self.final)
            raise
        _disown(self.path, now_at=self.final)  # its owner lock moved in with it
        self.path = self.final
        fsync_dir(self.final.parent)
        if had_old:
            shutil.rmtree(old, ignore_errors=True)

    def swapped(self) -> None:
        """Record a swap rank 0 did (the other ranks of a distributed run)."""
        self.path = self.final

    def abandon(self) -> None:
        """Undo a start that failed before its first checkpoint, so the same command works again."""
        if self.pending:
            shutil.rmtree(self.path, ignore_errors=True)
            _disown(self.path, now_at=None)
        elif self.fresh:
            for entry in list(self.path.iterdir()) if self.path.is_dir() else []:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            for folder in self.made:  # deepest first; rmdir refuses a folder someone else filled
                with suppress(OSError):
                    folder.rmdir()


def config_diff(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Fields that differ between two nested config dicts, as 'a.b: old -> new'."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def _check_resumable(run_dir: Path, configs: dict[str, Any]) -> None:
    saved = read_run_config(run_dir, hint="cannot resume it")
    with suppress(Exception):  # fields added since the run was saved take their defaults
        saved["model"] = ModelConfig.from_dict(saved["model"]).to_dict()
        saved["train"] = TrainConfig.from_dict(saved["train"]).to_dict()
    # Training may be extended and averaging changed on resume; everything else must match.
    ignore = {"epochs", "max_steps", "average_last"}
    current = json.loads(json.dumps(configs))
    for key in ignore:
        saved["train"].pop(key, None)
        current.get("train", {}).pop(key, None)
    if diffs := config_diff(saved, current):
        raise RunDirError(f"cannot resume {run_dir}: its config differs from the one given in {len(diffs)} "
                          f"field(s): {'; '.join(diffs)}. Resume with the same options, or start a new run "
                          f"(another --run-dir, or --overwrite)")


def prepare_run_dir(run_dir: Path, configs: dict[str, Any], *, resume: bool, overwrite: bool,
                    echo: Callable[[str], None] = print) -> RunLocation:
    """Check ``run_dir`` against what was asked and write its marker and config.json: a resumed run's configs
    must match; an existing run needs ``overwrite`` and is replaced through a sibling."""
    run_dir = Path(run_dir)
    if str(run_dir).startswith("~"):  # a quoted ~ reaches us unexpanded: it would make a folder "~"
        raise RunDirError(f"run directory {run_dir}: '~' is not expanded here, so it would name a folder "
                          f"called '~'; write the path out (or leave ~ unquoted for the shell)")
    config_text = json.dumps(configs, indent=2) + "\n"
    clear_leftovers(run_dir, echo)
    try:
        if resume:
            _check_resumable(run_dir, configs)
            atomic_write_text(run_dir / CONFIG_FILE, config_text)  # the training length may have grown
            if read_marker(run_dir) is None:
                write_marker(run_dir, KIND_RUN)
            return RunLocation(final=run_dir, path=run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"{run_dir} is a file, not a directory; choose another --run-dir")
        if run_dir.is_dir() and any(run_dir.iterdir()):
            if not overwrite:
                raise RunDirError(f"run directory {run_dir} already exists; pass --resume to continue it "
                                  f"or --overwrite to start it again")
            final = check_replaceable(run_dir)
            location = RunLocation(final=final, path=final.with_name(f"{final.name}.tmp-{secrets.token_hex(4)}"))
            location.path.mkdir()
            _own(location.path)  # a sibling whose lock is free later was left by a dead process
        else:
            made = tuple(p for p in (run_dir, *run_dir.parents) if not p.exists())
            run_dir.mkdir(parents=True, exist_ok=True)
            location = RunLocation(final=run_dir, path=run_dir, fresh=True, made=made)
    except OSError as exc:
        raise RunDirError(f"cannot use {run_dir} as a run directory: {exc.strerror or exc}") from None
    try:
        write_marker(location.path, KIND_RUN)
        atomic_write_text(location.path / CONFIG_FILE, config_text)
    except BaseException as exc:
        location.abandon()
        if isinstance(exc, OSError):
            raise RunDirError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}") from None
        raise
    return location
