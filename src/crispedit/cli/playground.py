"""``crispedit playground``: a local web page to ask, edit and undo on one model (registered through
``crispedit.cli._COMMAND_MODULES``). Torch- and fastapi-free at import: the command checks its flags, that
fastapi and uvicorn are installed, the side files and the address, and only then loads the model."""

from __future__ import annotations

import ipaddress

from ..checks import check_int, check_positive_int
from .flags import (
    add_curvature_args,
    add_max_drift_arg,
    add_model_args,
    add_training_args,
    check_job_files,
    config_from_args,
)

__all__ = ["add_cli", "cmd_playground", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, ``127.x.x.x``, ``::1`` or ``[::1]``)."""
    host = host.strip().lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host).is_loopback
    except ValueError:
        return False


def cmd_playground(args) -> int:
    """``crispedit playground``: check everything cheap, bind the address, load the model, fetch the curvature
    once, then serve the page until Ctrl-C; returns the exit status."""
    config = config_from_args(args, method="crispedit")  # validates before anything slow happens
    check_int("--port", args.port, 0, 65535)
    for flag in ("kl_texts", "max_chars", "undo_depth"):
        check_positive_int(f"--{flag.replace('_', '-')}", getattr(args, flag))
    from ..playground.server import LOOPBACK_HOSTS, bind, create_app, require_web_packages, serve, url_of

    require_web_packages()
    check_job_files(args, config.n_cap)
    sock = bind(args.host, args.port)  # a taken port fails here, before the model loads
    try:
        from ..models import load_model  # torch: only now that every cheaper input is checked
        from ..playground.engine import Playground
        from ..progress import progress_lines

        progress = False if args.quiet else None
        with progress_lines(progress):  # off a terminal: a line per phase instead of bars
            print(f"loading {args.model} ...", flush=True)
            model, tok = load_model(
                args.model,
                dtype=args.dtype,
                device=args.device,
                trust_remote_code=args.trust_remote_code,
                progress=progress,
            )
            print("fetching the capability curvature (once; every edit reuses it) ...", flush=True)
            pg = Playground(
                model,
                tok,
                config,
                cache_file=args.cache,
                kl_text=args.kl_text,
                kl_texts=args.kl_texts,
                max_chars=args.max_chars,
                undo_depth=args.undo_depth,
                name=args.model,
                progress=progress,
            )
        where = "the cache" if pg.cache["hit"] else "a new collection"
        print(f"curvature of {len(pg.layers)} edit layer(s) from {where} in {pg.cache['seconds']:.1f} s", flush=True)
        # a loopback server answers to this machine's names, the one given and the address it prints
        allowed = (*LOOPBACK_HOSTS, args.host, sock.getsockname()[0]) if is_loopback(args.host) else None
        app = create_app(pg, allowed_hosts=allowed)
        if not is_loopback(args.host):
            print(f"note: {args.host} is reachable from other machines; anyone who reaches it can edit this model")
        print(f"crispedit playground: {url_of(sock)} (Ctrl-C stops it)", flush=True)
        serve(app, sock)
    finally:
        sock.close()
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit playground`` on ``subparsers``."""
    from ..playground.engine import DEFAULT_KL_TEXTS, DEFAULT_MAX_CHARS, DEFAULT_UNDO_DEPTH  # torch-free

    p = sub.add_parser(
        "playground",
        help="a local web page: ask the model, edit in a new answer (crispedit), "
        "see the answer, the WILD qa check and the drift, undo",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = a free one, printed)")
    add_curvature_args(p)
    add_training_args(p, method=False, options=["crispedit"])
    p.set_defaults(precision="auto")  # bf16 where native: an edit in under a minute on a CPU; lr: engine.LR_FACTOR
    add_max_drift_arg(p)
    p.add_argument("--cache", default=None, help="use this curvature cache file (checked against the model)")
    p.add_argument("--kl-text", default=None, help="held-out text the drift is measured on (default: bundled WikiText)")
    p.add_argument(
        "--kl-texts",
        type=int,
        default=DEFAULT_KL_TEXTS,
        help=f"held-out paragraphs the drift is measured on after each edit (default {DEFAULT_KL_TEXTS})",
    )
    p.add_argument(
        "--max-chars",
        type=int,
        default=DEFAULT_MAX_CHARS,
        help=f"longest question or answer the page takes (default {DEFAULT_MAX_CHARS} characters)",
    )
    p.add_argument(
        "--undo-depth",
        type=int,
        default=DEFAULT_UNDO_DEPTH,
        help=f"how many of the latest edits can be undone (default {DEFAULT_UNDO_DEPTH}; each keeps its "
        "delta in memory)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars while loading")
    p.set_defaults(func=cmd_playground)
