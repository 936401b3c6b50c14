"""Every public function, class and public method of a public class in ``src/crispedit`` has a docstring.

Read with :mod:`ast` (no module is imported: fast, torch-free). Public: the name does not start with ``_``;
definitions at module or class level count, including those under ``if`` / ``try`` / ``with`` blocks there,
not functions nested in function bodies.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "crispedit"
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BLOCKS = (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.ExceptHandler) + (
    (ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _undocumented(node: ast.AST, prefix: str = ""):
    """``(line, qualified name)`` of each public definition under ``node`` without a (non-blank) docstring."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFS):
            if child.name.startswith("_"):
                continue
            if not (ast.get_docstring(child) or "").strip():
                yield child.lineno, prefix + child.name
            if isinstance(child, ast.ClassDef):
                yield from _undocumented(child, f"{prefix}{child.name}.")
        elif isinstance(child, _BLOCKS):
            yield from _undocumented(child, prefix)


def test_every_public_definition_has_a_docstring():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} modules under {SRC}"
    missing = [f"{f.relative_to(SRC.parent)}:{line}: {name}"
               for f in files for line, name in _undocumented(ast.parse(f.read_text(encoding="utf-8"), str(f)))]
    assert not missing, "public definitions without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_what_it_should():
    tree = ast.parse('''
def f(): pass
def _g(): pass
class C:
    """doc"""
    def m(self): pass
    def _n(self): pass
    def __init__(self): pass
class _P:
    def m(self): pass
if True:
    def h(): pass
def ok():
    """doc"""
    def inner(): pass
''')
    assert [name for _, name in _undocumented(tree)] == ["f", "C.m", "h"]
