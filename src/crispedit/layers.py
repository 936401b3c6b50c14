"""Which layers of a model to edit: layer patterns, the decoder blocks, the default per family.

``resolve_layers(model, pattern)`` expands a module-path pattern with brace ranges, e.g.
``model.layers.{15-19}.mlp.down_proj`` or ``model.layers.{4,6,8-9}.mlp.down_proj``, and checks every
module exists and is a linear layer. ``default_layer_pattern(model)`` gives the documented default
per architecture (the MLP output projection of five consecutive blocks starting at half depth). Layers are
found from the model's structure and ``config.model_type``, never from its name.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .errors import CrispEditError
from .families import FamilyDefaults, defaults_for

__all__ = [
    "MLP_OUT_PROJ",
    "decoder_blocks",
    "model_family",
    "family_defaults",
    "default_layer_pattern",
    "expand_pattern",
    "is_linear",
    "as_weight_matrix",
    "weight_matrix",
    "resolve_layers",
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
            f"no default layers for model type {model_type!r}; pass --layers (e.g. "
            f"'model.layers.{{10-14}}.mlp.down_proj')"
        )
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
            out += expand_pattern(part[: m.start()] + item + part[m.end() :])
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
