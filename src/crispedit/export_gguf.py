"""A Hugging Face llama-family model directory as one GGUF file (llama.cpp's format), written with the PyPI
``gguf`` package: what ``crispedit export gguf MODEL_DIR --out FILE [--type f16|q8_0]`` runs.

The file holds what llama.cpp's ``llama`` architecture reads:

* metadata: ``llama.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv``, ``rope.freq_base``, ``rope.dimension_count`` (the head
  size; ``attention.key_length`` / ``value_length`` too when it is not ``hidden / heads``),
  ``attention.layer_norm_rms_epsilon``, ``vocab_size``; ``general.file_type``;
* the tokenizer (byte-level BPE only): ``tokenizer.ggml.model = gpt2``, the pre-tokenizer's llama.cpp name
  (``tokenizer.ggml.pre``), every token in id order (padded with ``[PADn]`` tokens of type UNUSED up to the
  model's vocabulary size), the merges, the token types (special added tokens CONTROL, other added tokens
  USER_DEFINED), the bos / eos / unk / padding ids, whether BOS / EOS are added, and the chat template;
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

from .errors import CrispEditError, atomic_file, check_input_dir, check_output_file

__all__ = ["GGUF_TYPES", "check_export", "export_gguf", "gguf_tensor_name", "permute_rotary", "tokenizer_fields"]

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

# llama.cpp's pre-tokenizer names for the tokenizers' pre-tokenizer shapes it knows (tokenizer.json form).
_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


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
        raise CrispEditError(f"export gguf writes llama-family models (model_type llama, e.g. SmolLM2); {model_dir} "
                             f"is a {family or 'model of unknown family'!s} model")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CrispEditError(f"export gguf: {model_dir} has {key}=true; llama.cpp's llama architecture has no "
                                 "biases there")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in (None, "default"):
        raise CrispEditError(f"export gguf: {model_dir} uses rope scaling {kind!r}; only plain rotary embeddings "
                             "are written")
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
        raise CrispEditError(f"export gguf: a projection of {rows} rows does not split into {n_head} heads of even size")
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


def tokenizer_fields(tokenizer, vocab_size: int) -> dict:
    """The GGUF tokenizer metadata of a byte-level BPE ``tokenizer`` (a transformers fast tokenizer) for a model
    with ``vocab_size`` embedding rows: ``pre`` (llama.cpp's pre-tokenizer name), ``tokens`` (id order, padded
    to ``vocab_size`` with ``[PADn]``), ``token_types`` (gguf ``TokenType`` values), ``merges`` (``"a b"``),
    ``bos`` / ``eos`` / ``unk`` / ``pad`` ids (None when absent), ``add_bos`` / ``add_eos`` and
    ``chat_template``. One-line error for any other kind of tokenizer."""
    from gguf.constants import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise CrispEditError("export gguf needs a fast (tokenizer.json) tokenizer; this model has a slow one only")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    pre = _pre_name(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise CrispEditError(f"export gguf writes byte-level BPE tokenizers (tokenizer.ggml.model gpt2); this one is "
                             f"{model.get('type')} with a {decoder} decoder")
    if pre is None:
        raise CrispEditError(f"export gguf: the tokenizer's pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:120]} "
                             "has no llama.cpp name (known: gpt-2, smollm, llama-bpe)")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens") or []}
    by_id.update({i: a["content"] for i, a in added.items()})
    n = max(by_id) + 1 if by_id else 0
    if sorted(by_id) != list(range(n)):
        raise CrispEditError("export gguf: the tokenizer's ids are not contiguous from 0")
    if n > vocab_size:
        raise CrispEditError(f"export gguf: the tokenizer has {n} tokens, more than the model's {vocab_size} embeddings")
    tokens = [by_id[i] for i in range(n)] + [f"[PAD{i}]" for i in range(n, vocab_size)]
    types = [int(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED) if i in added
             else int(TokenType.NORMAL) for i in range(n)] + [int(TokenType.UNUSED)] * (vocab_size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    template = getattr(tokenizer, "chat_template", None)
    return {"pre": pre, "tokens": tokens, "token_types": types, "merges": merges, "bos": bos, "eos": eos,
            "unk": tokenizer.unk_token_id, "pad": tokenizer.pad_token_id,
            "add_bos": bos is not None and len(with_special) > len(plain) and with_special[0] == bos,
            "add_eos": eos is not None and len(with_special) > len(plain) and with_special[-1] == eos,
            "chat_template": template if isinstance(template, str) else None}


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
            tensors.append((gname, quantize(np.ascontiguousarray(w), GGMLQuantizationType.Q8_0),
                            GGMLQuantizationType.Q8_0))
        else:
            tensors.append((gname, np.ascontiguousarray(w, dtype=np.float16), None))
    return tensors


def _add_model_metadata(writer, name: str, cfg, qtype: str, dims: dict) -> None:
    """Add to ``writer`` (a ``GGUFWriter``) the general keys (type, ``name``, file type for ``qtype``, the
    quantization version for ``q8_0``) and the ``llama.*`` hyperparameters of ``cfg`` with the head settings
    ``dims`` (:func:`_llama_dims`); key and value lengths only when heads × head size is not the hidden size."""
    from gguf.constants import GGML_QUANT_VERSION, LlamaFileType

    heads, head_dim = dims["heads"], dims["head_dim"]
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int({"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
                              "f32": LlamaFileType.ALL_F32}[qtype]))
    if qtype == "q8_0":
        writer.add_quantization_version(GGML_QUANT_VERSION)
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
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if tk[key] is not None:
            add(int(tk[key]))
    writer.add_add_bos_token(bool(tk["add_bos"]))
    writer.add_add_eos_token(bool(tk["add_eos"]))
    if tk["chat_template"]:
        writer.add_chat_template(tk["chat_template"])


def _write_gguf(path: Path, name: str, cfg, qtype: str, dims: dict, tk: dict, tensors: list[tuple],
                progress: bool | None) -> dict[str, int]:
    """Write the GGUF file ``path`` (architecture ``llama``): the model metadata (:func:`_add_model_metadata`),
    the tokenizer metadata ``tk`` and the ``tensors`` (:func:`_gguf_tensors`), in that order; the writer is
    closed even on failure. Returns the tensor count per GGML type name (``F32``, ``F16``, ``Q8_0``)."""
    import numpy as np
    from gguf import GGUFWriter

    types: dict[str, int] = {}
    writer = GGUFWriter(str(path), "llama")
    try:
        _add_model_metadata(writer, name, cfg, qtype, dims)
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
    ``{"out", "bytes", "seconds", "tensors", "types"}`` (``types``: GGML type name -> tensor count)."""
    check_export(model_dir, out, qtype)
    t0 = time.perf_counter()
    import gguf  # noqa: F401  (a missing gguf package fails here, before the model loads)

    from .models import load_model

    model, tok = load_model(str(model_dir), dtype="float32", progress=progress)
    cfg = model.config
    dims = _llama_dims(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tk = tokenizer_fields(tok, cfg.vocab_size)
    tensors = _gguf_tensors(model, qtype, dims["heads"], dims["kv_heads"], tied)
    del model

    name = Path(model_dir).resolve().name
    with atomic_file(out) as tmp:
        types = _write_gguf(tmp, name, cfg, qtype, dims, tk, tensors, progress)
    return {"out": str(out), "bytes": Path(out).stat().st_size, "seconds": round(time.perf_counter() - t0, 2),
            "tensors": len(tensors), "types": types}
