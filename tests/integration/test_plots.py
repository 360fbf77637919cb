"""Every plot writes a valid PNG of the expected size; `aiayn plot` prints its path."""

from __future__ import annotations

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
