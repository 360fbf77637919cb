"""Screenshots of every view, for the docs: ``python -m aiayn.explore.screenshots --out docs/explore
--translation RUN --char RUN [--minilm DIR] [--smollm2 FILE]``.

Each model's views are opened in chromium through Playwright; console errors abort the run."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.explore.models import Explorable, load_explorable

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def _attention(page: Any, ex: Explorable) -> None:
    page.wait_for_selector("canvas.head-cell[data-layer='0'][data-loaded='1']")
    layer = {"translation": ex.config.n_decoder_layers - 1, "decoder": min(3, ex.config.n_layers - 1)}.get(ex.kind, 1)
    page.click(f"canvas.head-cell[data-layer='{layer}'][data-head='1']")  # a deeper layer than the first
    page.wait_for_selector(f"#attn-detail-title:has-text('layer {layer}, head 1')")
    canvas = page.locator("#attn-heatmap")
    rows, cols = int(canvas.get_attribute("height")), int(canvas.get_attribute("width"))
    i, j = min(rows - 1, 6), min(cols - 1, 3)  # a cell near the top-left, on screen
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + (j + 0.5) * box["width"] / cols, box["y"] + (i + 0.5) * box["height"] / rows)


def _generate(page: Any, ex: Explorable) -> None:
    page.wait_for_selector("#gen-current")
    for _ in range(5):
        page.click("#gen-next")


def _beam(page: Any, ex: Explorable) -> None:
    page.wait_for_selector("#beam-svg")
    page.locator("#beam-size").fill("3")
    page.wait_for_timeout(1500)


ACTIONS: dict[str, Callable[[Any, Explorable], None]] = {
    "attention": _attention, "generate": _generate, "beam": _beam,
    "positions": lambda page, ex: page.wait_for_selector("#pos-model"),
    "training": lambda page, ex: page.wait_for_selector("#train-charts")}


def _palette(path: Path) -> None:
    """Re-save a screenshot with a 256-colour palette so the docs stay small."""
    from PIL import Image

    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def shoot(ex: Explorable, name: str, out: Path, browser: Any) -> list[Path]:
    """Every view ``ex`` has, as ``out/{name}-{view}.png``."""
    import uvicorn

    from aiayn.explore import create_app
    from aiayn.explore.server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ex), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    written = []
    try:
        page = browser.new_page(viewport={"width": 1360, "height": 960})
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        views = ex.summary()["views"]
        for view in ACTIONS:
            if views[view] is not None:
                continue
            page.goto(f"http://127.0.0.1:{port}/#{view}")
            page.wait_for_selector("body[data-ready='1']")
            ACTIONS[view](page, ex)
            page.wait_for_timeout(400)
            path = out / f"{name}-{view}.png"
            page.screenshot(path=str(path), full_page=view in ("positions", "training"))
            _palette(path)
            written.append(path)
            if errors:
                raise RuntimeError(f"console errors on {name} {view}: {errors}")
        page.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return written


def main(argv: list[str] | None = None) -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/explore"))
    parser.add_argument("--translation", type=Path, help="a translation run directory")
    parser.add_argument("--char", type=Path, help="a shakespeare-char run directory")
    parser.add_argument("--minilm", type=Path, help="the all-MiniLM-L6-v2 directory")
    parser.add_argument("--smollm2", type=Path, help="the SmolLM2 GGUF file")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    models = [("translation", dict(run_dir=args.translation)), ("shakespeare-char", dict(run_dir=args.char)),
              ("minilm", dict(model_path=args.minilm)), ("smollm2", dict(model_path=args.smollm2))]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for name, source in models:
            if next(iter(source.values())) is None:
                continue
            for path in shoot(load_explorable(**source), name, args.out, browser):
                print(path)
        browser.close()


if __name__ == "__main__":
    main()
