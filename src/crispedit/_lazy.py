"""Lazy package exports: a package names what it exports and where each lives, and a submodule is
imported on first access only. ``crispedit``, ``crispedit.editing`` and ``crispedit.evaluation`` use it so
that importing the command line (which reaches them) does not import torch or transformers."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``name`` lives in submodule ``exports[name]``
    (relative, e.g. ``".api"``): the first access imports that submodule and caches the value in the
    package's namespace; an unknown name raises :class:`AttributeError` (so ``from package import
    submodule`` still imports submodules)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__
