"""``aiayn explore``: a local web application to look inside a model aiayn runs.

``load_explorable`` picks the model at start-up; ``create_app`` builds the FastAPI application whose routes
compute each view from the model (``probes``, ``decoding``, ``search_tree``, ``positions``, ``training``);
``server.serve`` runs it. The front end (``static/``) ships inside the package."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiayn.explore.models import Explorable, ExploreInputError, load_explorable

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["Explorable", "ExploreInputError", "create_app", "load_explorable"]


def create_app(ex: Explorable) -> FastAPI:
    """The ASGI application for ``ex`` (FastAPI is imported only when an app is built)."""
    from aiayn.explore.app import create_app as _create_app

    return _create_app(ex)
