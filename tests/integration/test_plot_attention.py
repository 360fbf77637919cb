"""`aiayn plot attention` for every task and every kind of attention it has: a run of
each task (one training step of a small model), the command's PNG, its errors; the figure's colour
scales follow the data and its title fits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from aiayn import viz
from aiayn.cli import main
from aiayn.config import TrainConfig
from aiayn.data import data_dir
from aiayn.data.parallel import read_lines
from aiayn.tasks import TASKS, get_task
from aiayn.train.trainer import train

SMALL = dict(n_train=64, n_val=16, n_test=16)
TASK_OPTIONS = {"reverse": SMALL, "copy": SMALL, "set-anomaly": SMALL,
                "translation": dict(vocab_size=300, val_bleu=False, beam_size=1, max_tokens=256),
                "shakespeare-char": {}, "shakespeare-char-long": {}, "mlm": {},
                "shakespeare-bpe": dict(vocab_size=300), "text": {}}
KINDS = {"copy": ("cross", "encoder", "decoder"), "translation": ("cross", "encoder", "decoder"),
         "shakespeare-char": ("decoder",), "shakespeare-char-long": ("decoder",),
         "shakespeare-bpe": ("decoder",), "text": ("decoder",)}
MULTI30K = data_dir() / "multi30k"
HAVE_DATA = (MULTI30K / "train.en").is_file() and (data_dir() / "tinyshakespeare" / "input.txt").is_file()


# Tasks that fine-tune a model they load (init_from): no attention plot of their own.
FINE_TUNING = {"chat"}


def test_every_task_is_covered():
    assert set(TASKS) == set(TASK_OPTIONS) | FINE_TUNING
    for name, cls in TASKS.items():
        assert cls.attention_kinds == KINDS.get(name, () if name in FINE_TUNING else ("encoder",)), name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One run directory per task: 2 layers x 2 heads, one training step."""
    root = tmp_path_factory.mktemp("attention-runs")
    corpus = root / "corpus"
    corpus.mkdir()
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:30]
        for split in ("train", "val", "test2016"):
            (corpus / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    text = root / "text.txt"  # the text task's data: a few hundred lines of the Multi30k sentences
    text.write_text("\n".join(read_lines(MULTI30K / "train.en")[:300]) + "\n", encoding="utf-8")
    data = {"translation": {"corpus_dir": str(corpus)}, "text": {"data": [str(text)]}}
    out = {}
    for name, options in TASK_OPTIONS.items():
        task = get_task(name, **options, **data.get(name, {}))
        model_config = task.model_config().replace(d_model=16, n_heads=2, n_layers=2, n_decoder_layers=2,
                                                   d_ff=24)
        train_config = TrainConfig(task=name, max_steps=1, batch_size=8, eval_every=1, save_every=1,
                                   average_last=0)
        train(task, model_config, train_config, root / name, progress=False, make_plots=False,
              echo=lambda _: None)
        out[name] = root / name
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    return int(exited.value.code), captured.out, captured.err


def png_size(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


CASES = [(name, kind) for name in TASK_OPTIONS for kind in KINDS.get(name, ("encoder",))]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DATA, reason="Multi30k / Tiny Shakespeare not found (set AIAYN_DATA_DIR)")
@pytest.mark.parametrize(("task", "kind"), CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_plot_attention_of_every_task_and_kind(runs, task, kind, tmp_path, capsys):
    out = tmp_path / "attention.png"
    code, stdout, stderr = run_main(["plot", "attention", "--run", str(runs[task]), "--kind", kind,
                                     "--out", str(out)], capsys)
    assert code == 0, stderr
    assert stdout.strip() == str(out)
    width, height = png_size(out)  # 2 layers x 2 heads of 3.2 inches, 100 dpi
    assert width == round(100 * (2 * viz.PANEL_INCHES + 0.4)) and height == round(100 * (2 * viz.PANEL_INCHES + 0.9))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DATA, reason="Multi30k / Tiny Shakespeare not found (set AIAYN_DATA_DIR)")
def test_plot_attention_defaults_inputs_and_errors(runs, capsys):
    # the default kind goes to RUN/attention.png, another to RUN/attention-KIND.png
    assert run_main(["plot", "attention", "--run", str(runs["copy"])], capsys)[0] == 0
    assert (runs["copy"] / "attention.png").is_file()
    assert run_main(["plot", "attention", "--run", str(runs["copy"]), "--kind", "encoder"], capsys)[0] == 0
    assert (runs["copy"] / "attention-encoder.png").is_file()
    # inputs in each task's syntax
    for task, text in (("reverse", "0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5"), ("set-anomaly", "3"),
                       ("translation", "A man is riding a bike."), ("shakespeare-char", "ROMEO:")):
        code, _, stderr = run_main(["plot", "attention", "--run", str(runs[task]), "--input", text], capsys)
        assert code == 0, (task, stderr)
    for task, argv, needle in (
        ("reverse", ["--kind", "cross"], "task reverse has encoder attention, not cross; choose --kind encoder"),
        ("shakespeare-char", ["--kind", "encoder"], "has decoder attention, not encoder"),
        ("set-anomaly", ["--input", "99999999"], "must be the number of a test set, 0 to "),
        ("set-anomaly", ["--input", "x"], "must be the number of a test set"),
        ("reverse", ["--input", "1 2"], "must hold exactly 16 integers"),
        ("shakespeare-char", ["--input", "\u00e9\u00e9"], "outside the vocabulary"),
    ):
        code, _, stderr = run_main(["plot", "attention", "--run", str(runs[task]), *argv], capsys)
        assert code == 2 and needle in stderr and "Traceback" not in stderr, (task, argv, stderr)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DATA, reason="Multi30k / Tiny Shakespeare not found (set AIAYN_DATA_DIR)")
def test_set_anomaly_plot_through_the_real_command(runs, tmp_path):
    """The reported failure (a traceback: `text` missing), through a subprocess as a user runs it."""
    out = tmp_path / "set.png"
    result = subprocess.run([sys.executable, "-m", "aiayn", "plot", "attention", "--run", str(runs["set-anomaly"]),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert png_size(out)[0] > 0 and "Traceback" not in result.stderr


def test_colour_scale_follows_each_panel_and_has_a_bar():
    diffuse = torch.full((1, 4, 5), 0.2) + torch.linspace(0, 0.01, 5)  # max 0.21: one colour on 0-1
    sharp = torch.eye(4, 5)[None]
    fig = viz.attention_figure([torch.cat([diffuse, sharp])], list("abcd"), list("ABCDE"), title="t")
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [image.get_clim() for image in images] == [(0.0, pytest.approx(0.21)), (0.0, 1.0)]
    assert len(fig.axes) == 4  # two panels, two colour bars
    viz.plt.close(fig)


def test_a_long_title_fits_a_one_by_one_grid():
    title = "en->de: decoder cross-attention of every head, last layer last, on the first test sentence"
    fig = viz.attention_figure([torch.softmax(torch.randn(1, 3, 3), -1)], list("abc"), list("xyz"), title=title)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    for text in [fig._suptitle, *(ax.title for ax in fig.axes)]:
        box = text.get_window_extent(renderer)
        assert box.x0 >= figure_box.x0 and box.x1 <= figure_box.x1 and box.y1 <= figure_box.y1, text.get_text()
    assert "\n" in fig._suptitle.get_text()  # wrapped, not clipped
    viz.plt.close(fig)
