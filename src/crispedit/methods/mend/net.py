"""MEND's gradient-transform network (Mitchell et al. 2022, "Fast Model Editing at Scale"), its file format
and the one gradient computation it transforms.

For an edit layer ``s = W a`` (``W``: ``d_out x d_in``) the gradient of a loss summed over tokens is the sum
of rank-one terms ``δ_t u_tᵀ`` (``u_t``: the layer input at token ``t``, ``d_in``; ``δ_t``: the gradient of the
loss w.r.t. the layer output there, ``d_out``). MEND never forms that gradient: each token's factors go
through a small network,

    z = ([u; δ] − mean) / (std + eps)                (per-feature running normalisation, float64 statistics)
    h₀ = z,  h_{k+1} = h_k + clamp(((h_k Vₖᵀ) Uₖᵀ + b_k) ⊙ scale_k[l] + shift_k[l], min=0)
    [ũ; δ̃] = h_{n_hidden+1}

(``n_hidden + 1`` low-rank residual layers of rank ``r``, ``U`` initialised to zero so the network starts as
the identity; one network per weight shape ``(d_in, d_out)``, shared by every edit layer of that shape,
with a per-layer scale and shift ``l``), and the update of layer ``l`` is

    ΔW_l = −α_l Σ_t δ̃_t ũ_tᵀ                          (``d_out x d_in``; α_l a learned step per layer).

:class:`MENDNetwork` holds the transforms, the steps ``α`` and the normalisation statistics
(:class:`~crispedit.methods.ultraedit.editor.RunningNorm`, one per shape, fitted while training and frozen
afterwards). :func:`edit_factors` runs the one forward/backward that gives ``(u, δ)``; its loss is the sum
over requests of each request's mean target NLL (``prompt + " " + target``), so a request's factors do not
depend on which other requests share its batch and ``ΔW`` of a batch is the sum of the requests'.

Files (:func:`save_network` / :func:`load_network`): safetensors with the network's tensors and a
``crispedit_mend`` JSON metadata entry (format, the base model's weight fingerprint, the layers and their
shapes, the training settings and the training slice). Loading refuses another model, other layers or
shapes, and a damaged file, with one line. The default location (:func:`default_weights_path`) is
``<cache>/mend/<key>.safetensors``, the key a digest of the fingerprint and the layer names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ...atomic import atomic_save_safetensors
from ...curvature.lm_backward import head_on_rows
from ...data.edits import EditRequest
from ...data.tokenize import encode_pairs
from ...editing.rows import input_gradient_rows
from ...errors import CrispEditError
from ...layers import decoder_blocks, is_linear, weight_matrix
from ...models import cache_dir
from ...safetensors_io import load_safetensors, read_safetensors_header
from ...versions import check_written_by, stamped
from ..ultraedit.editor import RunningNorm
from . import MENDTrainConfig

__all__ = [
    "FORMAT_VERSION",
    "META_KEY",
    "MENDNetwork",
    "GradientTransform",
    "edit_factors",
    "added_deltas",
    "default_layers",
    "default_weights_path",
    "save_network",
    "load_network",
    "read_network_meta",
    "weights_key",
    "train_command_hint",
    "request_nll",
    "target_token_logprobs",
    "prompt_digests",
]

FORMAT_VERSION = 1
META_KEY = "crispedit_mend"
_EPS = 1e-7  # MEND's normalisation epsilon


def _shape_key(d_in: int, d_out: int) -> str:
    return f"{d_in}x{d_out}"


class _LowRankResidual(nn.Module):
    """One residual layer on ``dim`` features: ``x + clamp((x Vᵀ Uᵀ + b) ⊙ scale[mode] + shift[mode], min=0)``
    with ``V``: ``rank x dim`` (random, scaled by 1/√dim), ``U``: ``dim x rank`` (zero: identity at start), a
    bias and a per-mode scale (ones) and shift (zeros), ``n_modes x dim``."""

    def __init__(self, dim: int, rank: int, n_modes: int, generator: torch.Generator):
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, dim, generator=generator) / math.sqrt(dim))
        self.up = nn.Parameter(torch.zeros(dim, rank))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.scale = nn.Parameter(torch.ones(n_modes, dim))
        self.shift = nn.Parameter(torch.zeros(n_modes, dim))

    def forward(self, x: Tensor, mode: int) -> Tensor:
        """``x``: ``N x dim`` float32 -> ``N x dim``. The clamp (not a ReLU) passes gradient at exactly 0, so
        the zero-initialised ``U`` starts learning."""
        pre = (x @ self.down.T) @ self.up.T + self.bias
        pre = pre * self.scale[mode] + self.shift[mode]
        return x + pre.clamp(min=0)


class GradientTransform(nn.Module):
    """The transform of one weight shape: ``n_hidden + 1`` :class:`_LowRankResidual` layers on the
    ``d_in + d_out`` features of ``[u; δ]``, rank ``min(rank, d_in + d_out)``, ``n_modes`` edit layers."""

    def __init__(self, d_in: int, d_out: int, n_modes: int, rank: int, n_hidden: int, generator: torch.Generator):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        dim = d_in + d_out
        self.layers = nn.ModuleList(
            _LowRankResidual(dim, min(rank, dim), n_modes, generator) for _ in range(n_hidden + 1)
        )

    def forward(self, z: Tensor, mode: int) -> tuple[Tensor, Tensor]:
        """Normalised rows ``z`` (``N x (d_in + d_out)``) -> ``(ũ, δ̃)`` (``N x d_in``, ``N x d_out``, float32)."""
        h = z.float()
        for layer in self.layers:
            h = layer(h, mode)
        return h[:, : self.d_in], h[:, self.d_in :]


class MENDNetwork(nn.Module):
    """MEND for a set of edit layers (module docstring): ``transforms`` (one :class:`GradientTransform` per
    weight shape), ``alpha`` (one step per layer, in ``layers`` order) and ``norms`` (one
    :class:`RunningNorm` of ``[u; δ]`` per shape, float64). ``shapes``: layer -> ``(d_out, d_in)``."""

    def __init__(self, shapes: dict[str, tuple[int, int]], config: MENDTrainConfig):
        super().__init__()
        if not shapes:
            raise CrispEditError("MEND needs at least one edit layer")
        self.config = config
        self.layer_names = list(shapes)
        self.shapes = {n: (int(o), int(i)) for n, (o, i) in shapes.items()}
        groups: dict[str, list[str]] = {}
        for n, (d_out, d_in) in self.shapes.items():
            groups.setdefault(_shape_key(d_in, d_out), []).append(n)
        self.modes = {n: (key, names.index(n)) for key, names in groups.items() for n in names}
        gen = torch.Generator().manual_seed(config.seed)
        self.transforms = nn.ModuleDict(
            {
                key: GradientTransform(*map(int, key.split("x")), len(names), config.rank, config.n_hidden, gen)
                for key, names in groups.items()
            }
        )
        self.alpha = nn.Parameter(torch.full((len(self.layer_names),), float(config.edit_lr)))
        self.norms = {key: RunningNorm(sum(map(int, key.split("x")))) for key in groups}

    def normalised(self, name: str, U: Tensor, D: Tensor, update: bool = False) -> Tensor:
        """``[U; D]`` rows of layer ``name`` (``N x d_in``, ``N x d_out``) normalised by its shape's running
        statistics (float64, ``N x (d_in + d_out)``); ``update`` first adds the rows to the statistics
        (training). One-line error when no statistics exist (a network that never trained)."""
        key, _ = self.modes[name]
        rows = torch.cat([U.double(), D.double()], 1)
        norm = self.norms[key]
        if update:
            norm.update(rows)
        if norm.n < 2:
            raise CrispEditError(
                "this MEND network has no normalisation statistics (it was never trained); "
                "train it with `crispedit mend train`"
            )
        norm.mean, norm.m2 = norm.mean.to(rows.device), norm.m2.to(rows.device)
        return (rows - norm.mean) / (norm.std + _EPS)

    def delta(self, name: str, U: Tensor, D: Tensor, update: bool = False) -> Tensor:
        """``ΔW = −α_l Σ_t δ̃_t ũ_tᵀ`` of layer ``name`` (``d_out x d_in``, float32) from its factor rows ``U``
        (``N x d_in``) and ``D`` (``N x d_out``); differentiable in the network's parameters."""
        key, mode = self.modes[name]
        z = self.normalised(name, U, D, update).float()
        u_t, d_t = self.transforms[key](z, mode)
        return -self.alpha[self.layer_names.index(name)] * (d_t.T @ u_t)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the network for a file: parameters (``transforms.*``, ``alpha``) and the statistics
        (``norm.<shape>::n / ::mean / ::m2``), CPU, contiguous."""
        out = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        for key, norm in self.norms.items():
            out.update(norm.to_tensors(f"norm.{key}"))
        return out

    def load_tensors(self, tensors: dict[str, Tensor], where: str) -> None:
        """Load :meth:`tensors` output (one-line error naming ``where`` for a missing, extra, misshapen or
        non-finite tensor)."""
        state = {k: v for k, v in tensors.items() if not k.startswith("norm.")}
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise CrispEditError(
                f"MEND network {where} does not match its settings (missing {missing[:2]}, unexpected {extra[:2]})"
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape) or not bool(torch.isfinite(v).all()):
                raise CrispEditError(
                    f"MEND network {where} is corrupt: tensor {k} has shape {tuple(v.shape)} "
                    f"(expected {tuple(own[k].shape)}) or non-finite values"
                )
        self.load_state_dict(state)
        for key in self.norms:
            if f"norm.{key}::n" not in tensors:
                raise CrispEditError(f"MEND network {where} is incomplete: no normalisation statistics for {key}")
            self.norms[key] = RunningNorm.from_tensors(tensors, f"norm.{key}", self.norms[key].mean.numel())


# ---------------------------------------------------------------------------------------------
# layers and factors


def default_layers(model: nn.Module, blocks: int = 3) -> list[str]:
    """MEND's default edit layers: every linear module inside the MLP of the last ``blocks`` decoder blocks
    (Llama-style ``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj``; GPT-2 ``mlp.c_fc``, ``mlp.c_proj``), in
    module order. One-line error when the blocks have no ``mlp`` submodule (pass ``--layers``)."""
    prefix, mods = decoder_blocks(model)
    out: list[str] = []
    for i in range(max(0, len(mods) - blocks), len(mods)):
        for rel, m in mods[i].named_modules():
            if rel.split(".")[0] == "mlp" and is_linear(m):
                out.append(f"{prefix}.{i}.{rel}")
    if not out:
        raise CrispEditError("cannot find the MLP linear layers of the last decoder blocks for MEND; pass --layers")
    return out


def target_token_logprobs(model: nn.Module, batch) -> tuple[Tensor, Tensor]:
    """Log-probability (float32) of every target token of ``batch`` (an
    :class:`~crispedit.data.tokenize.EncodedBatch`) and the row it belongs to, both ``M`` long (``M`` target
    tokens). The output head runs on the target positions only (:func:`~crispedit.curvature.lm_backward.head_on_rows`,
    the K-FAC collection's hook: exact for any logit post-processing after the head); a model without an
    exposed head forms the full logits and gathers them."""
    labels = batch.labels[:, 1:]
    valid = labels != -100
    positions = torch.zeros_like(batch.labels, dtype=torch.bool)
    positions[:, :-1] = valid
    with head_on_rows(model, positions):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logits = logits.squeeze(0) if tuple(logits.shape[:2]) != tuple(positions.shape) else logits[positions]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[valid].unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)[valid]
    return lp, rows


def _request_losses(model: nn.Module, batch) -> Tensor:
    """Per-row mean cross-entropy over the target tokens of ``batch`` (``B``)."""
    lp, rows = target_token_logprobs(model, batch)
    B = batch.labels.shape[0]
    total = torch.zeros(B, device=lp.device).index_add(0, rows, -lp)
    count = torch.zeros(B, device=lp.device).index_add(0, rows, torch.ones_like(lp))
    return total / count.clamp_min(1)


def edit_factors(
    model: nn.Module, tokenizer, requests: Sequence[EditRequest], layers: dict[str, nn.Module], batch_size: int = 32
) -> dict[str, tuple[Tensor, Tensor]]:
    """MEND's factors of ``requests`` at every edit layer: ``(U, D)`` with ``U`` the layer inputs (``N x d_in``)
    and ``D`` the gradients of ``Σ_requests mean target NLL`` w.r.t. the layer outputs (``N x d_out``), float32
    on the model's device, one row per token of ``prompt + " " + target`` where both are non-zero (padding
    and the positions after the last target token drop out). Model parameters get no gradient; chunks of
    ``batch_size`` requests give the same rows as one batch."""
    device = next(model.parameters()).device

    def batches():
        """The requests' ``prompt + " " + target`` sequences, ``batch_size`` at a time, on the model's device."""
        for b in range(0, len(requests), batch_size):
            chunk = requests[b : b + batch_size]
            yield encode_pairs(tokenizer, [r.prompt for r in chunk], [r.target for r in chunk], max_len=10**6).to(
                device
            )

    was_training = model.training
    model.eval()
    try:
        rows = input_gradient_rows(
            model,
            layers,
            batches(),
            lambda batch: (_request_losses(model, batch).sum(), batch.attention_mask.bool()),
            what="mend",
            dtype=torch.float32,
        )
    finally:
        model.train(was_training)
    out = {}
    for n, (u, d) in rows.items():
        nz = (u != 0).any(-1) & (d != 0).any(-1)
        out[n] = (u[nz], d[nz])
    return out


@contextlib.contextmanager
def added_deltas(layers: dict[str, nn.Module], deltas: dict[str, Tensor]) -> Iterator[None]:
    """Run ``layers`` as if ``deltas[name]`` (``d_out x d_in``) were added to their weights: a forward hook adds
    ``x ΔWᵀ`` to each output (the weights stay untouched; gradients flow into ``deltas``)."""

    def hook_for(dW: Tensor):
        """A forward hook adding ``x dWᵀ`` (``dW``: ``d_out x d_in``) to its layer's output."""

        def hook(mod, args, output):
            """Forward hook: ``output + x dWᵀ`` for the layer input ``x``, in ``output``'s dtype."""
            return output + (args[0].to(dW.dtype) @ dW.T).to(output.dtype)

        return hook

    handles = [layers[n].register_forward_hook(hook_for(dW)) for n, dW in deltas.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# files


def weights_key(fingerprint: str, layer_names: Sequence[str]) -> str:
    """24-hex-digit SHA-256 of the model fingerprint, the layer names and the format: the cache key."""
    blob = json.dumps(
        {"model_fingerprint": fingerprint, "layers": list(layer_names), "format": FORMAT_VERSION}, sort_keys=True
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def default_weights_path(fingerprint: str, layer_names: Sequence[str], root: str | Path | None = None) -> Path:
    """Where ``crispedit mend train`` writes and the ``mend`` editor looks by default:
    ``<root or cache_dir()>/mend/<weights_key>.safetensors``."""
    return Path(root or cache_dir()) / "mend" / f"{weights_key(fingerprint, layer_names)}.safetensors"


def train_command_hint(model_spec: str = "smollm2") -> str:
    """The command that trains a network (for error messages)."""
    return (
        f"crispedit mend train --model {model_spec} --edits EDITS.json --offset 1000 --n-edits 1000 "
        "(same --layers as the edit)"
    )


def save_network(path: str | Path, net: MENDNetwork, *, model_fingerprint: str, training: dict | None = None) -> Path:
    """Write ``net`` to ``path`` as safetensors atomically, with the metadata ``crispedit_mend``: format, model
    fingerprint, layers and shapes (``[d_out, d_in]``), training settings and ``training`` (slice, losses,
    seconds). Refuses non-finite tensors. Returns ``path``."""
    from ...checks import check_finite_tensors

    tensors = net.tensors()
    check_finite_tensors({k: v for k, v in tensors.items() if not k.startswith("norm.")}, "MEND training")
    meta = stamped(
        {
            "format": FORMAT_VERSION,
            "model_fingerprint": model_fingerprint,
            "layers": net.layer_names,
            "shapes": {n: list(s) for n, s in net.shapes.items()},
            "config": net.config.to_json(),
            "training": training or {},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    atomic_save_safetensors(path, tensors, metadata={META_KEY: json.dumps(meta)})
    return Path(path)


def read_network_meta(path: str | Path) -> dict:
    """The ``crispedit_mend`` metadata of network file ``path``; one-line errors for a missing, damaged or
    foreign file and for one another crispedit version wrote (:func:`~crispedit.versions.check_written_by`)."""
    meta, _ = read_safetensors_header(path, "MEND network", META_KEY)
    check_written_by(
        meta, f"MEND network file {path}", "train it again with `crispedit mend train`", format=FORMAT_VERSION
    )
    for key in ("model_fingerprint", "layers", "shapes", "config"):
        if key not in meta:
            raise CrispEditError(f"MEND network file {path} is malformed: no {key!r}")
    return meta


def load_network(path: str | Path, layers: dict[str, nn.Module], *, model_fingerprint: str | None) -> MENDNetwork:
    """The network in ``path`` for edit ``layers`` (name -> module) of the model with ``model_fingerprint``
    (``None``: not checked). One-line errors when it was trained for another model, other
    layers or other shapes, or the file is damaged."""
    meta = read_network_meta(path)
    if model_fingerprint is not None and meta["model_fingerprint"] != model_fingerprint:
        raise CrispEditError(
            f"MEND network {path} was trained for another model (fingerprint "
            f"{str(meta['model_fingerprint'])[:12]}…, this model is {model_fingerprint[:12]}…; an "
            "already edited model, "
            "e.g. a later session round, counts as another); train one for this model with "
            "`crispedit mend train`"
        )
    if list(meta["layers"]) != list(layers):
        raise CrispEditError(
            f"MEND network {path} was trained for layers {meta['layers']}, not {list(layers)}; "
            "pass the same --layers or train a network for these"
        )
    for n, m in layers.items():
        if list(meta["shapes"].get(n, [])) != list(weight_matrix(m).shape):
            raise CrispEditError(
                f"MEND network {path} expects layer {n} of shape {meta['shapes'].get(n)}, "
                f"this model's is {list(weight_matrix(m).shape)}"
            )
    config = MENDTrainConfig.from_json(meta["config"])
    net = MENDNetwork({n: tuple(s) for n, s in meta["shapes"].items()}, config)
    _, tensors = load_safetensors(path, "MEND network", META_KEY)
    net.load_tensors(tensors, str(path))
    net.meta = meta
    return net


def prompt_digests(requests: Sequence[EditRequest]) -> list[str]:
    """A 12-hex-digit digest of each request's ``prompt`` and ``target``: what a network file records of its
    training requests, so an edit can tell how many of its requests the network was trained on."""
    return [hashlib.blake2b(f"{r.prompt}\x00{r.target}".encode(), digest_size=6).hexdigest() for r in requests]


def request_nll(model: nn.Module, tokenizer, requests: Sequence[EditRequest], prompts: str = "prompt") -> Tensor:
    """Mean target NLL (nats/token, over every target token) of ``requests`` asked with their prompts
    (``prompts="prompt"``) or their prompts and rephrasings (``"both"``): a scalar with the model's graph."""
    ps, ts = [], []
    for r in requests:
        for p in [r.prompt] + (list(r.rephrase_prompts) if prompts == "both" else []):
            ps.append(p)
            ts.append(r.target)
    device = next(model.parameters()).device
    batch = encode_pairs(tokenizer, ps, ts, max_len=10**6).to(device)
    lp, _ = target_token_logprobs(model, batch)
    return -lp.mean()
