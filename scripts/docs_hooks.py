"""MkDocs hooks for the documentation site (``mkdocs.yml``: ``hooks``).

- ``results/`` (the summary page, its tables and figures) and ``CONTRIBUTING.md`` join the site from outside
  ``docs/``, under ``results/`` and ``contributing.md``; the links the pages write for GitHub
  (``../results/…``, ``../CONTRIBUTING.md``, ``../README.md``) are rewritten to them, so the same Markdown
  works on GitHub and on the site and a dead one fails the strict build.
- ``reference/cli.md`` is generated from the command line's own parser (``crispedit.cli.build_parser``, torch-free):
  every sub-command's ``--help``, so a renamed flag changes the page.
- Sphinx roles left in docstrings (``:func:`x``` …) are shown as code.
"""

from __future__ import annotations

import io
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULT_SUFFIXES = {".md", ".png", ".json", ".csv", ".txt", ".sh"}


def _cli_reference() -> str:
    """Markdown: ``crispedit --help`` and every sub-command's (nested ones included)."""
    sys.path.insert(0, str(ROOT / "src"))
    import argparse

    from crispedit.cli import build_parser

    parser = build_parser()
    parser.prog = "crispedit"
    out = [
        "# Command line reference",
        "",
        "Generated from the command line's own parser when the site is built: what `crispedit … --help` prints.",
        "The task pages ([edit](../cli.md), [compare](../compare.md), …) say what the commands are for.",
        "",
    ]

    def walk(p: argparse.ArgumentParser, name: str, depth: int) -> None:
        buf = io.StringIO()
        with redirect_stdout(buf):
            p.print_help()
        out.extend([f"{'#' * min(depth, 4)} `{name}`", "", "```text", buf.getvalue().rstrip(), "```", ""])
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, sp in action.choices.items():
                    sp.prog = f"{name} {sub}"
                    walk(sp, f"{name} {sub}", depth + 1)

    walk(parser, "crispedit", 2)
    return "\n".join(out)


def on_files(files, config):
    """Add ``results/`` and ``CONTRIBUTING.md`` from outside ``docs/``, and the generated CLI reference."""
    for path in sorted((ROOT / "results").rglob("*")):
        if path.is_file() and path.suffix in RESULT_SUFFIXES and path.name != "make.py":
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    files.append(File.generated(config, "contributing.md", abs_src_path=str(ROOT / "CONTRIBUTING.md")))
    files.append(File.generated(config, "reference/cli.md", content=_cli_reference()))
    return files


def _prefix(src_uri: str) -> str:
    """The relative path from a page's folder to the site's root (``""``, ``"../"``, …)."""
    return "../" * src_uri.count("/")


def on_page_markdown(markdown, page, config, files):
    """Rewrite the GitHub-style links that leave ``docs/`` to where those files are on the site."""
    if page.file.src_uri == "contributing.md":  # at the repository's root on GitHub, at the site's root here
        return re.sub(r"\]\(docs/", "](", markdown)
    if page.file.src_uri.startswith("results/"):  # its links stay inside results/
        return markdown
    up = _prefix(page.file.src_uri)
    markdown = re.sub(rf"\]\({re.escape(up)}\.\./results/", f"]({up}results/", markdown)
    markdown = re.sub(rf"\]\({re.escape(up)}\.\./CONTRIBUTING\.md", f"]({up}contributing.md", markdown)
    return re.sub(rf"\]\({re.escape(up)}\.\./README\.md", f"]({up}README.md", markdown)


def on_page_content(html, page, config, files):
    """Sphinx roles of docstrings (``:func:`name``` rendered as ``:func:<code>name</code>``) as plain code."""
    return re.sub(r":(?:func|class|meth|data|attr|mod|exc|obj):(<code>)~?", r"\1", html)
