"""``aiayn explore``: a local web application to look inside a model (``load_explorable`` picks it,
``create_app`` builds the FastAPI app, ``server.serve`` runs it; the front end is ``static/``)."""

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
