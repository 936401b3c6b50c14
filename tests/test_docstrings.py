"""Every public function, class and public method of a public class in ``src/crispedit`` has a docstring,
and so does every public function nested in a function or method body.

Read with :mod:`ast` (no module is imported: fast, torch-free). Public: the name does not start with ``_``.
At module or class level, definitions count (including those under ``if`` / ``try`` / ``with`` blocks
there) when they and every class or function around them are public. In a function body (of any function
or method, public or not, at any depth of blocks), every function with a public name counts; classes
defined there, and their methods, do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "crispedit"
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BLOCKS = (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.ExceptHandler) + (
    (ast.TryStar,) if hasattr(ast, "TryStar") else ()
)


def _undocumented(node: ast.AST, prefix: str = "", in_function: bool = False, public: bool = True):
    """``(line, qualified name)`` of each public definition under ``node`` without a (non-blank) docstring.

    ``in_function``: ``node`` is (inside) a function body, where only functions count; ``public``: every
    definition around ``node`` is public (a module/class-level definition counts only then)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFS):
            is_function = not isinstance(child, ast.ClassDef)
            is_public = not child.name.startswith("_")
            counts = is_public and (is_function if in_function else public)
            if counts and not (ast.get_docstring(child) or "").strip():
                yield child.lineno, prefix + child.name
            yield from _undocumented(
                child, f"{prefix}{child.name}.", is_function, public and is_public and not in_function
            )
        elif in_function or isinstance(child, _BLOCKS):
            yield from _undocumented(child, prefix, in_function, public)


def test_every_public_definition_has_a_docstring():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} modules under {SRC}"
    missing = [
        f"{f.relative_to(SRC.parent)}:{line}: {name}"
        for f in files
        for line, name in _undocumented(ast.parse(f.read_text(encoding="utf-8"), str(f)))
    ]
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
    def m(self):
        def p_inner(): pass
if True:
    def h(): pass
def ok():
    """doc"""
    def inner(): pass
    def _private(): pass
    def documented():
        """doc"""
        def deeper(): pass
    with open("x"):
        def in_block(): pass
def _g():
    def g_inner(): pass
''')
    assert [name for _, name in _undocumented(tree)] == [
        "f",
        "C.m",
        "_P.m.p_inner",
        "h",
        "ok.inner",
        "ok.documented.deeper",
        "ok.in_block",
        "_g.g_inner",
    ]
