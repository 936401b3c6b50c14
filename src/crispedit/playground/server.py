"""The playground's web side: a FastAPI app over a :class:`~.engine.Playground`, served by uvicorn.

Routes: ``GET /`` (the page, ``static/index.html``), ``GET /playground.js`` and ``/playground.css``, ``GET
/api/state``, and ``POST /api/ask`` (``{"question"}``), ``/api/edit`` (``{"question", "answer"}``) and
``/api/undo`` (no body). Every answer is JSON; a refused request is ``{"error": one line}`` with status 400
(bad input — a body that is not JSON or is nested too deeply included —, nothing to undo), 409 (busy: another
request holds the model), 415 (a POST whose body is not declared JSON: a form another site posts cross-origin
is refused before it is read) or 500 (a bug, its traceback on the server's stderr). With ``allowed_hosts``
(the default for a loopback address), a request whose ``Host`` header names another host is refused (400):
a web page cannot reach the server through a rebound DNS name. Every spelling of an allowed name is taken:
with or without a port, an IPv6 address bracketed or not, in any case (:func:`host_allowed`).

fastapi and uvicorn are imported by the functions that need them, never by ``import crispedit``;
:func:`require_web_packages` names the one that is missing in a line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import TYPE_CHECKING

from ..checks import check_int
from ..errors import CrispEditError
from .engine import PlaygroundBusy

if TYPE_CHECKING:
    from .engine import Playground

__all__ = [
    "require_web_packages",
    "create_app",
    "host_allowed",
    "bind",
    "url_of",
    "serve",
    "running_server",
    "LOOPBACK_HOSTS",
    "STATIC_FILES",
]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
STATIC_FILES = {
    "/": ("index.html", "text/html"),
    "/playground.js": ("playground.js", "text/javascript"),
    "/playground.css": ("playground.css", "text/css"),
}
_CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"


def require_web_packages() -> None:
    """One-line :class:`CrispEditError` naming what is missing when fastapi or uvicorn is not installed
    (found without importing either)."""
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise CrispEditError(
            f"crispedit playground needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install {' '.join(missing)} "
            "(or pip install 'crispedit[playground]')"
        )


_PORT = re.compile(r"[0-9]*")


def _host_name(name: str) -> str:
    """A host name in one spelling: lower case, an IP address in its compressed form without brackets."""
    name = name.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


def _host_of(header: str) -> str | None:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``; a bare IPv6 address is
    taken too) in :func:`_host_name`'s spelling; ``None`` when the header is malformed."""
    h = header.strip()
    if h.startswith("["):
        end = h.find("]")
        if end < 0 or (h[end + 1 :] and not (h[end + 1] == ":" and _PORT.fullmatch(h[end + 2 :]))):
            return None
        name = h[: end + 1]
    elif h.count(":") == 1:
        name, port = h.split(":")
        if not _PORT.fullmatch(port):
            return None
    else:
        name = h
    return _host_name(name) or None


def host_allowed(header: str | None, allowed: Sequence[str]) -> bool:
    """Whether a request's ``Host`` header names one of ``allowed`` (host names or IP addresses, IPv6 ones
    bracketed or not): the port is ignored, names compare case-insensitively and addresses by value
    (``[::1]:8000`` is ``::1``; ``[0:0::1]`` too). A missing or malformed header is not allowed."""
    host = _host_of(header) if header else None
    return host is not None and host in {_host_name(a) for a in allowed}


class _HostCheck:
    """ASGI middleware: a request whose ``Host`` header :func:`host_allowed` refuses gets a 400 JSON error."""

    def __init__(self, app, allowed_hosts: Sequence[str]):
        self.app, self.allowed = app, list(allowed_hosts)

    async def __call__(self, scope, receive, send):
        """Pass an allowed request (and any non-HTTP event) to the app; answer the others with 400."""
        if scope["type"] in ("http", "websocket"):
            raw = next((v for k, v in scope.get("headers", []) if k == b"host"), None)
            header = None if raw is None else raw.decode("latin-1")
            if not host_allowed(header, self.allowed):
                from fastapi.responses import JSONResponse

                names = ", ".join(self.allowed)
                await JSONResponse(
                    {"error": f"Invalid host header {header!r}: this server answers to {names} only"}, 400
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def create_app(playground: Playground, *, allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS):
    """The FastAPI app serving the page and the API over ``playground`` (see the module docstring);
    ``allowed_hosts``: the ``Host`` names a request may give, in any spelling :func:`host_allowed` takes
    (``None``: any, for a server bound to a public address)."""
    require_web_packages()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="crispedit playground", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_hosts is not None:
        app.add_middleware(_HostCheck, allowed_hosts=list(allowed_hosts))
    pages = {path: (_static(name), kind) for path, (name, kind) in STATIC_FILES.items()}

    # Starlette routes (app.add_route): each endpoint gets the request itself, no FastAPI parameter parsing
    async def page(request: Request) -> Response:
        """One of :data:`STATIC_FILES`, uncached, under a same-origin-only content security policy."""
        text, kind = pages[request.url.path]
        return Response(text, media_type=kind, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store"})

    for path in pages:
        app.add_route(path, page, methods=["GET"], include_in_schema=False)

    async def call(request: Request, action: Callable[[dict], dict]) -> JSONResponse:
        """``action(body)`` on a worker thread, its result or its refusal as JSON (module docstring)."""
        from starlette.concurrency import run_in_threadpool

        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and kind != "application/json":
            return JSONResponse({"error": "send the request as JSON (Content-Type: application/json)"}, 415)
        try:
            body = await request.json() if int(request.headers.get("content-length") or 0) else {}
        except ValueError:
            return JSONResponse({"error": "the request body is not valid JSON"}, 400)
        except RecursionError:  # the JSON decoder recurses once per level of nesting
            return JSONResponse({"error": "the request body is nested too deeply"}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": f"the request body must be a JSON object, got {type(body).__name__}"}, 400)
        try:
            return JSONResponse(await run_in_threadpool(action, body))
        except PlaygroundBusy as exc:
            return JSONResponse({"error": str(exc), "busy": True}, 409)
        except CrispEditError as exc:
            return JSONResponse({"error": str(exc)}, 400)
        except Exception as exc:  # a bug: the page gets a line, the server's log the traceback
            traceback.print_exc(file=sys.stderr)
            return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]}, 500)

    routes = {
        "/api/state": ("GET", lambda body: playground.state()),
        "/api/ask": ("POST", lambda body: playground.ask(body.get("question"))),
        "/api/edit": (
            "POST",
            lambda body: playground.edit(body.get("question"), body.get("answer"), body.get("subject")),
        ),
        "/api/undo": ("POST", lambda body: playground.undo()),
    }

    def route(action: Callable[[dict], dict]):
        """The endpoint answering with ``action``."""

        async def endpoint(request: Request) -> JSONResponse:
            """The JSON answer of this route's action (:func:`create_app`)."""
            return await call(request, action)

        return endpoint

    for path, (method, action) in routes.items():
        app.add_route(path, route(action), methods=[method], include_in_schema=False)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to ``host``:``port`` (``0``: a free port the system picks; an IPv6
    ``host`` bracketed or not); one-line :class:`CrispEditError` when the port is out of range or the address
    cannot be taken (in use, not this machine's). Binding first lets a command refuse a taken port before it
    loads a model."""
    port = check_int("--port", port, 0, 65535)
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address as URLs write it
        host = host[1:-1]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CrispEditError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CrispEditError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port/`` of a bound socket (IPv6 addresses bracketed; a wildcard address as given)."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def _server(app, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))


def serve(app, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve ``app`` on the bound ``sock`` in this thread until Ctrl-C (uvicorn)."""
    _server(app, log_level).run(sockets=[sock])


@contextlib.contextmanager
def running_server(app, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 30.0) -> Iterator[str]:
    """``app`` served by uvicorn on a daemon thread while the block runs; yields its URL (``port`` 0: a free
    one). Waits up to ``timeout`` seconds for the server to start; stops it and joins the thread on exit."""
    sock = bind(host, port)
    server = _server(app, "warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="crispedit-playground", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the playground server did not start within {timeout:g} s")
        time.sleep(0.02)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
