"""Running the explorer: uvicorn on 127.0.0.1 by default (any other address gets a warning: no login)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import webbrowser
from collections.abc import Callable

from aiayn.explore.models import Explorable


class ServeError(OSError):
    """The server cannot start (e.g. the port is taken); the message says what to do."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """Raise ServeError unless ``host:port`` can be bound now."""
    from aiayn.serve.server import check_port as probe

    probe(host, port, advice="give another --port (or --port 0 for any free one)", error=ServeError)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (tests and --port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def serve(ex: Explorable, *, host: str = "127.0.0.1", port: int = 8765, open_browser: bool = True,
          echo: Callable[[str], None] = print) -> None:
    """Serve the explorer for ``ex`` until interrupted."""
    import uvicorn

    from aiayn.explore import create_app

    if port == 0:
        port = free_port(host if is_loopback(host) else "0.0.0.0")
    check_port(host, port)
    # On every interface (0.0.0.0, ::) this machine's own browser opens the loopback address.
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    if not is_loopback(host):
        echo(f"Warning: listening on {host}, not 127.0.0.1: anyone who can reach this machine on port "
             f"{port} can use the explorer (there is no login). Use --host 127.0.0.1 to keep it local.")
    echo(f"aiayn explore: {ex.name} ({ex.kind}, {ex.origin})")
    echo(f"open {url}   (Ctrl-C stops)")
    config = uvicorn.Config(create_app(ex), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    if open_browser:
        def open_when_up() -> None:
            while not server.started and not server.should_exit:
                threading.Event().wait(0.05)
            if server.started:
                webbrowser.open(url)

        threading.Thread(target=open_when_up, daemon=True).start()
    server.run()
