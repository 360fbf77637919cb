"""``aiayn explore``: a local web application to look inside a model aiayn runs.

The model is chosen at start-up (``load_explorable``: a run directory, a GGUF file or a Hugging
Face directory); ``create_app`` builds the ASGI application (FastAPI) whose routes compute what
the views show from the model itself (``probes``: attention weights; ``decoding``: decode steps
and the KV cache; ``search_tree``: the beam-search tree; ``positions``; ``training``: the run's
record); ``server.serve`` runs it on uvicorn. The front end (``static/``: ES modules, CSS, SVG
and canvas, no build step, no network) ships inside the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiayn.explore.models import Explorable, ExploreInputError, load_explorable

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["Explorable", "ExploreInputError", "create_app", "load_explorable"]


def create_app(ex: Explorable) -> FastAPI:
    """The ASGI application for ``ex`` (see ``aiayn.explore.app``; FastAPI is imported only when an
    app is built)."""
    from aiayn.explore.app import create_app as _create_app

    return _create_app(ex)
