"""``crispedit playground``: a local web page to ask a model a question, edit in a new answer with
crispedit on curvature fetched once at start-up, see the answer, the WILD ``qa`` check and the drift, and
undo edits bit for bit. :mod:`.engine` holds the model side (:class:`~.engine.Playground`), :mod:`.server`
the FastAPI app and uvicorn, ``static/`` the page. Importing the package imports neither torch nor fastapi."""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["Playground", "PlaygroundBusy", "check_text"], ".engine"),
    **dict.fromkeys(["create_app", "bind", "serve", "running_server", "require_web_packages", "url_of"], ".server"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "Playground",
    "PlaygroundBusy",
    "check_text",
    "create_app",
    "bind",
    "serve",
    "running_server",
    "require_web_packages",
    "url_of",
]
