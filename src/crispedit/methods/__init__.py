"""The editing methods: one module or package per method (the folder list reads as the paper's method list).

A method declares itself in one place, its module's (or package's) ``METHOD``: a
:class:`~crispedit.editing.registry.MethodSpec` with its ``--method`` name, a one-line summary, its options
(a :class:`~crispedit.editing.registry.MethodConfig` dataclass defined beside it) and where its editor class
lives. That top level is torch-free: a method whose editor needs nothing heavy at import is one module
(``ft.py``: the editor subclasses :class:`~crispedit.editing.editor.Editor`, which imports torch only when it
runs); a method whose editor does is a package whose ``__init__`` holds the ``Config`` and ``METHOD`` and whose
editor module (``memit/editor.py``) is imported only when an edit runs
(:func:`~crispedit.editing.registry.editor_class`).

Importing this package discovers every module and package in it (names starting with ``_`` excepted) and adds
their ``METHOD`` to the catalogue: nothing else lists the methods. The registry imports it by name the first
time the catalogue is read, so ``--help``, ``--method`` choices and argument errors need no torch.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..editing.registry import MethodSpec, add_method

__all__ = ["BUILTIN_METHODS", "discover"]


def discover(package: str = __name__) -> tuple[MethodSpec, ...]:
    """Import every module and package directly under ``package`` (not those named ``_...``) and add each one's
    ``METHOD`` to the catalogue; returns the specs in name order. A module without a ``METHOD`` is an error
    (``TypeError``): every public module here is a method."""
    pkg = importlib.import_module(package)
    specs = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        spec = getattr(module, "METHOD", None)
        if not isinstance(spec, MethodSpec):
            raise TypeError(
                f"{module.__name__} defines no METHOD (a MethodSpec); every public module of {package} is a method"
            )
        specs.append(add_method(spec))
    return tuple(specs)


BUILTIN_METHODS: tuple[MethodSpec, ...] = discover()
