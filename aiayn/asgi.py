"""What aiayn's two ASGI applications (``aiayn.serve``, ``aiayn.explore``) share: the body-size
bound on a request as it streams in, and how an error message shows user input (a short prefix)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Message, Receive


def preview(text: str, limit: int = 64, *, quote: bool = True) -> str:
    """User input as an error message shows it: at most ``limit`` characters (a 100 KB model name
    is not echoed back), quoted with repr unless ``quote`` is False."""
    short = text if len(text) <= limit else text[:limit] + "..."
    return repr(short) if quote else short


def bounded_receive(receive: Receive, limit: int, too_large: Callable[[], Exception]) -> Receive:
    """``receive`` that raises ``too_large()`` once more than ``limit`` body bytes have arrived (a
    body with no declared length, or one longer than it declared)."""
    received = 0

    async def bounded() -> Message:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise too_large()
        return message

    return bounded
