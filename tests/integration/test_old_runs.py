"""Run directories written before the nn/ + fast/ redesign still load and compute what they did.

tests/fixtures/old_runs holds three tiny runs (encoder-only, encoder-decoder, decoder-only) trained
by the old code, with the outputs that code computed on fixed inputs (see its README). Today's
code must load them (configs, checkpoints) and give the same logits, plain and through aiayn.fast,
and a run must resume from its old checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from aiayn.fast import optimize
from aiayn.generate import greedy_decoder_only
from aiayn.tasks.runs import load_run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs"


@pytest.fixture
def old_runs(tmp_path: Path) -> Path:
    """A copy of the fixtures (the tests must not write into the repository)."""
    return Path(shutil.copytree(FIXTURES, tmp_path / "old_runs"))


def _logits(name: str, model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        if name == "copy":
            return model(expected["src"], expected["tgt"]).logits
        return model(expected["tokens"]).logits


@pytest.mark.parametrize("name", ["reverse", "copy", "shakespeare"])
@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
def test_old_run_loads_and_computes_what_it_did(old_runs: Path, name: str, fast: bool) -> None:
    run = load_run(old_runs / name, prepare=False)
    model = run.model.eval()
    if fast:
        optimize(model, mode="inference")
    expected = load_file(str(old_runs / name / "expected.safetensors"))
    assert_close(_logits(name, model, expected), expected["logits"])
    if name == "shakespeare":
        greedy = greedy_decoder_only(model, expected["tokens"], max_new_tokens=8).tokens
        assert torch.equal(greedy, expected["greedy"])


def test_old_run_resumes_with_todays_trainer(old_runs: Path, run_aiayn) -> None:
    run_dir = old_runs / "reverse"
    code, out, err = run_aiayn("train", "--resume", "--run-dir", str(run_dir), "--max-steps", "4", "--no-progress")
    assert code == 0, err
    assert "resuming" in out and "step 3" in out
    state = json.loads((run_dir / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["step"] == 4
