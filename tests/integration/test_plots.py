"""Every plot writes a valid PNG of the expected size; `aiayn plot` prints its path."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib.image
import pytest
import torch

from aiayn import viz
from aiayn.train.optim import cosine_lr, noam_lr


def png_shape(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_positional_encoding_plots(tmp_path):
    assert png_shape(viz.plot_positional_encoding(tmp_path / "pe.png")) == (900, 400)
    assert png_shape(viz.plot_pe_dot_products(tmp_path / "dot.png")) == (700, 400)


def test_lr_schedule_plot(tmp_path):
    schedules = {"noam": lambda s: noam_lr(s, d_model=512, warmup=400),
                 "cosine": lambda s: cosine_lr(s, peak=1e-3, warmup=100, total=2000)}
    assert png_shape(viz.plot_lr_schedules(schedules, 2000, tmp_path / "lr.png")) == (700, 400)


def test_attention_grid_size_follows_layers_and_heads(tmp_path):
    weights = [torch.softmax(torch.randn(3, 5, 7), -1) for _ in range(2)]  # 2 layers x 3 heads
    assert viz.PANEL_INCHES * 3 + 0.4 > viz.MIN_WIDTH_INCHES
    path = viz.plot_attention(weights, list("abcde"), list("ABCDEFG"), tmp_path / "attn.png")
    assert png_shape(path) == (round(100 * (viz.PANEL_INCHES * 3 + 0.4)), round(100 * (viz.PANEL_INCHES * 2 + 0.9)))
    one = viz.plot_attention([weights[0][:1]], list("abcde"), list("ABCDEFG"), tmp_path / "one.png")
    assert png_shape(one) == (round(100 * viz.MIN_WIDTH_INCHES), round(100 * (viz.PANEL_INCHES + 0.9)))


def test_metrics_plot(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("step,epoch,lr,train_loss,val_nll\n1,0,0.001,2.0,\n2,0,0.002,1.0,\n2,0,,,1.5\n")
    assert png_shape(viz.plot_metrics(csv_path, tmp_path / "curves.png")) == (1100, 400)


def write_metrics(run: Path, rows: list[str]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return run


def test_runs_compared_on_one_plot(tmp_path, run_aiayn):
    """`aiayn plot loss --run A --run B`: both runs' val NLL and val score (BLEU here) on one PNG;
    a release folder is read through its record/ (the shipped model beside a new run)."""
    header = "step,epoch,lr,train_loss,val_nll,val_bleu"
    a = write_metrics(tmp_path / "a", [header, "1,0,0.001,3.0,,", "2,0,0.001,2.5,2.4,10.0", "4,1,0.001,2.0,2.1,20.0"])
    b = write_metrics(tmp_path / "release" / "record", [header, "1,0,0.001,3.2,,", "2,0,0.001,3.1,3.0,5.0"]).parent
    out = tmp_path / "both.png"
    code, stdout, err = run_aiayn("plot", "loss", "--run", str(a), "--run", str(b), "--label", "a run",
                                  "--label", "shipped", "--out", str(out))
    assert code == 0, err
    assert stdout.strip() == str(out) and png_shape(out) == (1100, 400)
    rows = {name: viz.read_metrics(run / "metrics.csv") for name, run in (("a", a), ("b", b / "record"))}
    assert rows["a"][1] == {"step": 2.0, "epoch": 0.0, "lr": 0.001, "train_loss": 2.5, "val_nll": 2.4, "val_bleu": 10.0}
    # No score column (a task without BLEU or accuracy): the loss panel alone.
    plain = {"x": [{"step": 1.0, "val_nll": 2.0}], "y": [{"step": 1.0, "val_nll": 3.0}]}
    assert png_shape(viz.plot_runs(plain, tmp_path / "plain.png")) == (600, 400)
    # Runs before their first validation (train loss only): no legend, and no matplotlib warning for an empty one.
    early = {"x": [{"step": 1.0, "train_loss": 2.0}], "y": [{"step": 1.0, "train_loss": 3.0}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert png_shape(viz.plot_runs(early, tmp_path / "early.png")) == (600, 400)


@pytest.mark.parametrize(("content", "message"), [
    (b"step,epoch,lr,train_loss\n1,0,abc,2.0\n", "metrics.csv, line 2: a value is not a number; the file is damaged"),
    (b"\x00\xff\xfe garbage", "metrics.csv is not a CSV file (UnicodeDecodeError)"),
    (b"loss,acc\n1,2\n", "metrics.csv has no header with a step column"),
    (b"step,val_nll\n", "metrics.csv has no rows yet"),
])
def test_a_bad_metrics_file_is_one_line(tmp_path, run_aiayn, content, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_bytes(content)
    code, stdout, err = run_aiayn("plot", "loss", "--run", str(run), "--out", str(tmp_path / "x.png"))
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "x.png").exists()


def test_runs_to_compare_need_names_of_their_own(tmp_path, run_aiayn):
    run = write_metrics(tmp_path / "run", ["step,train_loss", "1,2.0"])
    for args, message in ((["--run", str(run), "--run", str(run)], "two runs have one name; give each its own --label"),
                          (["--run", str(run), "--label", "a", "--label", "b"], "2 --label for 1 --run")):
        code, _, err = run_aiayn("plot", "loss", *args, "--out", str(tmp_path / "x.png"))
        assert code == 2 and message in err, err


@pytest.mark.parametrize(("args", "name", "size"), [
    (["pe", "--d-model", "32"], "pe.png", (900, 400)),
    (["pe-dot"], "dot.png", (700, 400)),
    (["lr", "--warmups", "100,400", "--steps", "1000"], "lr.png", (700, 400)),
])
def test_plot_cli(tmp_path, run_aiayn, args, name, size):
    """In this process (test_shipped_models runs `aiayn plot` as a child process)."""
    out = tmp_path / name
    code, stdout, err = run_aiayn("plot", *args, "--out", str(out))
    assert code == 0, err
    assert stdout.strip() == str(out)
    assert png_shape(out) == size


def test_plot_cli_errors(tmp_path, run_aiayn):
    code, _, err = run_aiayn("plot", "pe", "--d-model", "31")  # run_aiayn fails the test on a traceback
    assert code == 2 and "31 is odd" in err
    code, _, err = run_aiayn("plot", "attention", "--run", str(tmp_path))
    assert code == 2 and "is not a run directory" in err
