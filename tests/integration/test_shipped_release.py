"""Releases (aiayn.tasks.shipped): a finished run written as a shipped model loads back and
computes what the run's model computes with its weights rounded to the release's dtype; tied
weights are stored once; a release is replaced whole; bad releases and names give one message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from aiayn.tasks import shipped, trained
from aiayn.tasks.runs import RunInputError, load_run
from aiayn.tasks.shipped import write_release
from aiayn.tasks.trained import load_release, resolve_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs"
INPUTS = {"copy": lambda: (torch.randint(4, 11, (2, 7)), torch.randint(4, 11, (2, 5))),
          "reverse": lambda: (torch.randint(0, 10, (2, 9)),), "shakespeare": lambda: (torch.randint(0, 65, (2, 11)),)}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES, tmp_path / "runs"))


@pytest.mark.parametrize("name", sorted(INPUTS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_release_computes_what_the_rounded_run_computes(runs: Path, tmp_path: Path, name: str, dtype: str) -> None:
    out = write_release(runs / name, tmp_path / "release", dtype=dtype)
    release = load_release(out)
    run = load_run(runs / name, prepare=False)
    low = trained.RELEASE_DTYPES[dtype]
    with torch.no_grad():
        for p in run.model.parameters():
            p.copy_(p.to(low).float())
        inputs = INPUTS[name]()
        assert_close(release.model(*inputs).logits, run.model(*inputs).logits, rtol=0, atol=0)
    assert all(p.dtype == torch.float32 for p in release.model.parameters())
    record = json.loads((out / "release.json").read_text())
    assert record["task"] == run.task.name and record["dtype"] == dtype
    assert record["parameters"] == sum(p.numel() for p in run.model.parameters())  # unique parameters
    assert (out / "record" / "metrics.csv").is_file() and (out / "config.json").is_file()


def test_tied_weights_are_stored_once(runs: Path, tmp_path: Path) -> None:
    run = load_run(runs / "copy", prepare=False)
    state = run.model.state_dict()
    assert len({t.data_ptr() for t in state.values()}) < len(state), "the copy model ties its embeddings"
    out = write_release(runs / "copy", tmp_path / "release")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
        tied = json.loads(handle.metadata()["tied"])
    assert len(stored) == len({t.data_ptr() for t in state.values()})
    assert set(tied) | stored == set(state) and not set(tied) & stored
    loaded = load_release(out).model.state_dict()
    for alias, source in tied.items():
        assert loaded[alias].data_ptr() == loaded[source].data_ptr()  # still tied after loading


def test_no_local_folder_ships_in_the_record(runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths inside the run (an averaged checkpoint's, say) are written relative to it."""
    run = runs / "reverse"
    summary = {"step": 3, "averaged": {"checkpoint": str(run.resolve() / "averaged-last5" / "step-3")}}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "score.test.json").write_text(json.dumps({"hypotheses": str(run / "hypotheses.test.txt")}))
    out = write_release(run, tmp_path / "release")
    assert json.loads((out / "record" / "summary.json").read_text())["averaged"]["checkpoint"] == "averaged-last5/step-3"
    assert json.loads((out / "record" / "score.test.json").read_text()) == {"hypotheses": "hypotheses.test.txt"}
    monkeypatch.chdir(runs)  # the run named by a relative path: the same
    out = write_release(Path("reverse"), tmp_path / "release")
    assert str(tmp_path) not in (out / "record" / "summary.json").read_text()


def test_a_release_is_replaced_whole(runs: Path, tmp_path: Path) -> None:
    out = write_release(runs / "reverse", tmp_path / "release")
    (out / "stale.txt").write_text("from the old release")
    write_release(runs / "shakespeare", tmp_path / "release")
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "release.json").read_text())["task"] == "shakespeare-char"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "runs"]  # no .tmp/.old left


def test_an_interrupted_writes_leftovers_are_cleared_and_never_listed(runs: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = write_release(runs / "reverse", tmp_path / "release")
    shutil.copytree(out, tmp_path / "release.tmp")  # a write stopped before its rename: a release.json inside
    shutil.copytree(out, tmp_path / "release.old")  # a replacement stopped before removing the old one
    monkeypatch.setattr(trained, "SHIPPED_DIR", tmp_path)
    assert list(trained.shipped_models()) == ["release"]  # the leftovers are not models
    write_release(runs / "shakespeare", tmp_path / "release")
    assert json.loads((out / "release.json").read_text())["task"] == "shakespeare-char"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release", "runs"]


def test_oversized_release_is_refused(runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipped, "MAX_RELEASE_BYTES", 1000)
    with pytest.raises(ValueError, match="over the 0 MiB"):
        write_release(runs / "shakespeare", tmp_path / "release")
    assert not (tmp_path / "release").exists()


def test_bad_releases_and_names(runs: Path, tmp_path: Path) -> None:
    out = write_release(runs / "shakespeare", tmp_path / "release")
    (out / "model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(RunInputError, match="cannot be read"):
        load_release(out)
    with pytest.raises(RunInputError, match="not a shipped-model release"):
        load_release(runs / "shakespeare")
    with pytest.raises(RunInputError, match="neither a shipped model"):
        resolve_model("no-such-model")
    assert resolve_model(str(runs / "shakespeare")) == runs / "shakespeare"  # paths stay paths


def test_cli_names_an_unknown_model(tmp_path: Path) -> None:
    for args in (["translate", "--model", "no-such-model", "Hello."],
                 ["generate", "--model", "no-such-model", "--prompt", "x"]):
        proc = subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert "neither a shipped model" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) <= 2


def test_generate_and_translate_from_a_release(runs: Path, tmp_path: Path) -> None:
    out = write_release(runs / "shakespeare", tmp_path / "release")
    proc = subprocess.run([sys.executable, "-m", "aiayn", "generate", "--model", str(out), "--prompt", "RO",
                           "--max-new-tokens", "100", "--temperature", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("RO") and len(proc.stdout.strip()) >= 3
    # the fixture's context is 64 characters: generation slides past it, writes all 100 and says why it stopped
    assert len(proc.stdout) == len("RO") + 100
    assert "stopped: the token limit" in proc.stderr and "slid past the 64-token context" in proc.stderr


def test_explore_opens_a_release(runs: Path, tmp_path: Path) -> None:
    from aiayn.explore import load_explorable

    out = write_release(runs / "shakespeare", tmp_path / "release")
    explorable = load_explorable(model_path=out)
    assert explorable.kind == "decoder" and explorable.context == 64
    assert explorable.tokens("RO") == [explorable.tokens("R")[0], explorable.tokens("O")[0]]


def test_ship_model_script_writes_where_out_says_and_leaves_the_package_alone(runs: Path, tmp_path: Path) -> None:
    """scripts/ship_model.py --out: a run kept as a release outside aiayn/pretrained (a later ensemble's member)."""
    before = sorted(trained.shipped_models())
    out = tmp_path / "kept" / "reverse-seed0"
    script = Path(__file__).resolve().parents[2] / "scripts" / "ship_model.py"
    proc = subprocess.run([sys.executable, str(script), "--run", str(runs / "reverse"), "--name", "reverse-seed0",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"wrote {out}: ")
    assert json.loads((out / "release.json").read_text())["name"] == "reverse-seed0"
    assert load_release(out).task.name == "reverse"
    assert sorted(trained.shipped_models()) == before  # nothing written into the package
