"""The GPU benchmark (``python -m benchmarks.gpu``) and the GPU check (``scripts/gpu-check.sh``) run
here, on the CPU, at tiny sizes (``--smoke``, ``--cpu-smoke``): every row and ratio is printed, a
missing transformers skips its tests and peers with a line instead of crashing, and row (d) reads
the recipe's score. Their figures are not checked (tiny models on a shared CPU); on a GPU they are
what docs/gpu.md reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu
from benchmarks.gpu_models import run_recipe

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-check.sh"


@pytest.mark.slow
def test_smoke_prints_every_row_and_ratio(capsys):
    pytest.importorskip("transformers")
    gpu.main(["--smoke", "--device", "cpu", "--peak-tflops", "0.05"])
    out = capsys.readouterr().out
    assert "failed:" not in out and "skipped:" not in out and "not measured" not in out, out
    for title in ("## (a) GPT-2 training", "## (b) encoder-decoder `tiny`", "## (c) greedy decoding"):
        assert title in out
    for peer in ("aiayn", "aiayn compiled", "transformers", "transformers compiled", "torch.nn.Transformer",
                 "torch.nn.Transformer compiled", "transformers static + compile"):
        assert f"| {peer} |" in out, peer
    assert "(a) training tokens/s, compiled: aiayn compiled / transformers compiled = **" in out
    assert "(a) MFU of aiayn compiled = **" in out and "0.05 TFLOP/s (--peak-tflops)" in out
    assert "(b) training tokens/s, compiled: aiayn compiled / torch.nn.Transformer compiled = **" in out
    for b in (1, 2):
        assert f"(c) decode tokens/s, batch {b}, compiled: aiayn compiled / transformers static + compile = **" in out
    assert "(c) aiayn batch 1 = **" in out
    assert "greedy tokens, aiayn vs transformers (same weights): identical" in out  # the same converted weights


def test_profile_prints_each_peers_op_table(capsys):
    """``--profile``: after the row's table, one torch.profiler table per peer (here row (b))."""
    gpu.main(["--smoke", "--device", "cpu", "--rows", "b", "--profile"])
    out = capsys.readouterr().out
    for peer in ("aiayn", "aiayn compiled", "torch.nn.Transformer", "torch.nn.Transformer compiled"):
        assert f"### {peer}: torch.profiler, one call after the timed rounds" in out, peer
    assert out.count("Self CPU time total") == 4


def test_unknown_rows_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--rows", "ax", "--device", "cpu"])
    assert "--rows: unknown row(s) x" in capsys.readouterr().err


def test_recipe_row_reads_the_score_and_reports_a_failure(tmp_path):
    run_dir = tmp_path / "run"
    writes = f"import json, pathlib; d = pathlib.Path({str(run_dir)!r}); d.mkdir(); " \
             "(d / 'score.test2016.json').write_text(json.dumps({'bleu': 39.9}))"
    done = run_recipe([sys.executable, "-c", writes], run_dir, timeout=60)
    assert (done.returncode, done.bleu) == (0, 39.9) and done.seconds > 0
    failed = run_recipe([sys.executable, "-c", "import sys; print('no such option'); sys.exit(2)"],
                        tmp_path / "absent", timeout=60)
    assert (failed.returncode, failed.bleu) == (2, None) and "no such option" in failed.tail


def test_gpu_check_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_gpu_check_cpu_smoke_without_transformers(tmp_path):
    """The check's CPU-runnable parts, with transformers made unimportable (as on a GPU machine
    without it): the environment, a parity test that needs it (skipped, with its reason), one that
    does not, and benchmark row (c) (its transformers peers skipped); the log lands in $OUT."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "transformers.py").write_text("raise ModuleNotFoundError('transformers is hidden by the test', name='transformers')\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "PYTHONPATH": str(shim),
           "GPU_CHECK_TESTS": "tests/parity/test_losses_vs_torch.py tests/parity/test_hf_gpt2.py"}
    done = subprocess.run(["bash", str(SCRIPT), "--cpu-smoke", "--rows", "c"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert done.returncode == 0, log + done.stderr
    assert log == done.stdout  # everything printed is in the log
    assert "nvidia-smi: not found" in log or "NVIDIA" in log
    assert "transformers: not installed -> the Hugging Face parity tests skip" in log
    assert "3 passed, 1 skipped" in log and "transformers is hidden by the test" in log
    assert "| transformers | - | skipped: transformers: not installed (pip install -e '.[bench]') |" in log
    assert "| aiayn compiled |" in log and "(c) aiayn batch 1 = **" in log
    assert "not measured (transformers did not run)" in log
    summary = log.split("## summary")[1]
    assert all(f"{part}: passed" in summary for part in ("environment", "tests (cpu)", "benchmark row (c)"))
