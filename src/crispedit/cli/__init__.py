"""``crispedit`` command line: thin — parses, calls the library, prints.

One module per sub-command family (``_COMMAND_MODULES``): each defines ``add_cli(subparsers)``, sets
``func`` on its parsers (and ``torchrun=True`` on those that may run under ``torchrun``) and is torch-free
at import; :mod:`.flags` holds the flags several commands share. Errors a user can cause are printed as one
line (``crispedit: error: ...``) with exit status 2, and so is an :class:`OSError` that names a file or
refuses a write (no space, read-only, permission) on its way out of a command. Building the parser and
checking the arguments import neither torch nor transformers (the method catalogue and the configs are
torch-free); a command imports them once its cheap checks have passed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..distributed import launched_world_size  # torch-free at import
from ..errors import CrispEditError, os_error_line
from ..progress import log_lines

__all__ = ["build_parser", "main"]

# The sub-command modules, in the order `crispedit --help` lists their commands.
_COMMAND_MODULES: list[str] = [
    "crispedit.cli.edit",
    "crispedit.cli.cache",
    "crispedit.cli.demo",
    "crispedit.cli.playground",
    "crispedit.cli.evaluate",
    "crispedit.cli.session",
    "crispedit.cli.compare",
    "crispedit.cli.delta",
    "crispedit.cli.export",
    "crispedit.cli.mend",
    "crispedit.cli.mnist",
]


class _Parser(argparse.ArgumentParser):
    """argparse with crispedit's error format: one ``crispedit: error:`` line (no usage block), exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        """Print one ``crispedit: error:`` line naming the command and the problem, then exit 2."""
        self.exit(2, f"crispedit: error: {self.prog}: {message} (see {self.prog} --help)\n")


LOG_LEVELS = ("debug", "info", "warning", "error")


def _check_log_level(level: str) -> int:
    """The :mod:`logging` level of a ``--log-level`` / ``$CRISPEDIT_LOG_LEVEL`` value; one-line error for another."""
    if level not in LOG_LEVELS:  # (from $CRISPEDIT_LOG_LEVEL: argparse checks only the flag)
        raise CrispEditError(f"log level {level!r} (from CRISPEDIT_LOG_LEVEL?) is not one of {', '.join(LOG_LEVELS)}")
    return getattr(logging, level.upper())


def build_parser() -> argparse.ArgumentParser:
    """The ``crispedit`` argument parser with the sub-commands of every module in ``_COMMAND_MODULES``."""
    parser = _Parser(prog="crispedit", description="Non-destructive knowledge editing of LLMs (CrispEdit)")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("CRISPEDIT_LOG_LEVEL", "warning").lower(),
        choices=LOG_LEVELS,
        help="messages to print on stderr, with their time: info adds the "
        "progress of long work (an edit's epochs every few, the curvature collection) for output "
        "that is not a terminal, where there are no progress bars (default $CRISPEDIT_LOG_LEVEL or "
        "warning); give it before the command",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in _COMMAND_MODULES:
        importlib.import_module(mod).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: run one sub-command; user errors (and the file system's refusals, :func:`os_error_line`)
    print one ``crispedit: error:`` line and return 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a flag argparse refused (one line printed already)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        level = _check_log_level(args.log_level)
        if not getattr(args, "torchrun", False) and launched_world_size() > 1:
            raise CrispEditError(
                f"{parser.prog} {args.command}: only `cache build`, `edit` and `session add` run "
                "under torchrun; run this command in one process (it reuses the factors a torchrun "
                "cache build wrote)"
            )
        with log_lines(level, sys.stderr, "%(asctime)s %(name)s: %(message)s"):
            return int(args.func(args) or 0)
    except CrispEditError as exc:
        print(f"crispedit: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # crispedit's writers raise WriteError; this is what another path met
        line = os_error_line(exc)
        if line is None:
            raise
        print(f"crispedit: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("crispedit: interrupted", file=sys.stderr)
        return 130
