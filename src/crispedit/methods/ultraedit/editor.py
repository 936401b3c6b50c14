"""UltraEdit (Gu et al. 2025): training-free lifelong editing by a closed-form ridge solve per layer.

For each batch of edits (``batch_size``), on the current model: one forward/backward of the edit loss (mean
cross-entropy over the target tokens of the batch's training sequences — the shared edit contexts, as every
fine-tuning method trains them) gives, at every edit layer and every position that predicts a target
token, the layer input ``h`` (``d_in``) and the gradient ``g`` of the loss w.r.t. the layer output (``d_out``).
The rows ``[h‖g]`` update a **lifelong running normalisation** (mean and standard deviation over every row
seen so far, this edit's earlier batches and, in a session, earlier rounds), which gives ``[ĥ‖ĝ]``; the
pseudo-values are ``v = −lr·‖ĥ‖²·ĝ`` and the update is the ridge solution

    ΔWᵀ = (HᵀH + ridge·I)⁻¹ Hᵀ V        (H: rows h, raw; V: rows v)

added to the weight before the next batch. ``lr`` 1e-6 and ``ridge`` 1 are the authors'. The edit layers are
``--layers``, else the authors' layout placed by depth (:func:`default_layers`: ``gate_proj`` of the blocks at
11/32–15/32 of the depth, ``up_proj`` at 18/32–24/32). Statistics and the solve in float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...editing.editor import EditContext
from ...editing.history import TrainHistory
from ...editing.loop import edit_batches
from ...editing.rows import input_gradient_rows
from ...editing.single_pass import SinglePassEditor
from ...errors import CrispEditError
from ...layers import decoder_blocks, default_layer_pattern, resolve_layers, weight_matrix
from . import UltraEditConfig

__all__ = ["UltraEditConfig", "UltraEditEditor", "RunningNorm", "ultraedit_delta", "pseudo_values"]


class RunningNorm:
    """Running mean and standard deviation of rows (float64): ``n`` rows seen, ``mean`` and ``m2`` (sum of
    squared deviations) per feature, merged batch by batch with the exact parallel update (Chan et al.)."""

    def __init__(self, size: int, n: float = 0.0, mean: Tensor | None = None, m2: Tensor | None = None):
        self.n = float(n)
        self.mean = mean.double() if mean is not None else torch.zeros(size, dtype=torch.float64)
        self.m2 = m2.double() if m2 is not None else torch.zeros(size, dtype=torch.float64)

    def update(self, x: Tensor) -> None:
        """Add the rows of ``x`` (``N x size``)."""
        x = x.double().to(self.mean.device)
        nb = x.shape[0]
        if nb == 0:
            return
        mb = x.mean(0)
        m2b = ((x - mb) ** 2).sum(0)
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * nb / n
        self.m2 = self.m2 + m2b + delta**2 * self.n * nb / n
        self.n = n

    @property
    def std(self) -> Tensor:
        """Sample standard deviation per feature (``m2 / (n − 1)``, square root)."""
        return (self.m2 / max(self.n - 1.0, 1.0)).sqrt()

    def __call__(self, x: Tensor) -> Tensor:
        """``(x − mean) / (std + eps)`` in float64."""
        return (x.double().to(self.mean.device) - self.mean) / (self.std + torch.finfo(torch.float32).eps)

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        """The state as tensors ``<prefix>::n``, ``::mean``, ``::m2`` (what a session stores)."""
        return {
            f"{prefix}::n": torch.tensor([self.n], dtype=torch.float64),
            f"{prefix}::mean": self.mean.cpu(),
            f"{prefix}::m2": self.m2.cpu(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str, size: int) -> RunningNorm:
        """Rebuild from :meth:`to_tensors` output; a fresh normaliser when ``prefix`` is absent."""
        if f"{prefix}::n" not in tensors:
            return cls(size)
        mean = tensors[f"{prefix}::mean"]
        if mean.numel() != size:
            raise CrispEditError(f"ultraedit state for {prefix} has {mean.numel()} features, not {size}")
        return cls(size, float(tensors[f"{prefix}::n"][0]), mean, tensors[f"{prefix}::m2"])


def pseudo_values(h_hat: Tensor, g_hat: Tensor, lr: float) -> Tensor:
    """``v = −lr·‖ĥ‖²·ĝ`` per row (``N x d_out``)."""
    return -lr * (h_hat * h_hat).sum(-1, keepdim=True) * g_hat


def ultraedit_delta(H: Tensor, V: Tensor, ridge: float = 1.0) -> Tensor:
    """``ΔW = ((HᵀH + ridge·I)⁻¹ HᵀV)ᵀ`` in float64: ``H`` ``N x d_in`` keys, ``V`` ``N x d_out`` values; returns
    ``d_out x d_in`` (the ridge regression of the values on the keys)."""
    H, V = H.double(), V.double()
    eye = torch.eye(H.shape[1], dtype=torch.float64, device=H.device)
    return torch.linalg.solve(H.T @ H + ridge * eye, H.T @ V).T


# The authors' Llama-3-8B layout (32 blocks): gate_proj of blocks 11-15, up_proj of blocks 18-24, as depth fractions.
AUTHORS_LAYOUT = (("gate_proj", 11 / 32, 15 / 32), ("up_proj", 18 / 32, 24 / 32))


def default_layers(model) -> str:
    """UltraEdit's default edit layers: its authors' Llama-3-8B layout placed by depth — ``mlp.gate_proj`` of
    blocks ``round(11N/32) … round(15N/32)`` and ``mlp.up_proj`` of ``round(18N/32) … round(24N/32)`` for
    ``N`` decoder blocks (halves round up; 32 blocks give the authors' 11–15 and 18–24, SmolLM2's 30 give
    10–14 and 17–23). Models whose blocks have no ``mlp.gate_proj`` / ``mlp.up_proj`` get the shared
    default (:func:`~crispedit.layers.default_layer_pattern`)."""
    prefix, blocks = decoder_blocks(model)
    n = len(blocks)
    names = dict(model.named_modules())
    parts = []
    for proj, lo, hi in AUTHORS_LAYOUT:
        a, b = math.floor(lo * n + 0.5), math.floor(hi * n + 0.5)
        if not all(f"{prefix}.{i}.mlp.{proj}" in names for i in range(a, b + 1)):
            return default_layer_pattern(model)
        parts.append(f"{prefix}.{{{a}-{b}}}.mlp.{proj}")
    return ",".join(parts)


class UltraEditEditor(SinglePassEditor):
    """UltraEdit: per batch, normalised gradient pseudo-values written into the edit layers by a ridge solve. The
    history's ``epoch_loss`` holds the mean target NLL (nats/token, bare prompt) before and after, ``steps`` the
    number of batches written."""

    name = "ultraedit"
    carries_state = True  # the lifelong normalisation goes from round to round
    form = "ridge"

    def select_layers(self, model, config):
        """``--layers``; else the authors' layout placed by depth (:func:`default_layers`)."""
        return resolve_layers(model, config.layers or default_layers(model))

    def _rows(self, model, tokenizer, chunk, layers, config, history: TrainHistory) -> dict[str, tuple[Tensor, Tensor]]:
        """``(H, G)`` per layer: inputs and output gradients at the target-predicting positions of every
        training sequence of ``chunk`` (float64, CPU); counts the sequences and tokens into ``history``."""
        device = next(model.parameters()).device
        batches, history.contexts = edit_batches(tokenizer, chunk, config, model)
        history.sequences += sum(b.input_ids.shape[0] for b in batches)
        history.tokens += sum(b.n_tokens for b in batches)

        def loss(b):
            """The batch's mean cross-entropy over its target tokens, and the positions predicting them."""
            b = b.to(device)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
            labels = b.labels[:, 1:]
            pos = labels != -100
            return F.cross_entropy(logits[pos], labels[pos]), pos

        return input_gradient_rows(model, layers, batches, loss, what="ultraedit", dtype=torch.float64, device="cpu")

    def start(self, model, tokenizer, requests, ctx: EditContext) -> dict:
        """Each edit layer's shape and running normalisation (continued from ``ctx.optimizer_state``)."""
        shapes = {n: tuple(weight_matrix(m).shape) for n, m in ctx.layers.items()}
        return {
            "shapes": shapes,
            "norms": {
                n: RunningNorm.from_tensors(ctx.optimizer_state, n, d_in + d_out) for n, (d_out, d_in) in shapes.items()
            },
        }

    def updates(self, model, tokenizer, requests, ctx: EditContext, state: dict, history):
        """Batch by batch (module docstring), yielding each layer's ``ΔW`` in turn (the model in eval mode)."""
        cfg: UltraEditConfig = ctx.config.method_config
        layers, shapes, norms = ctx.layers, state["shapes"], state["norms"]
        was_training = model.training
        model.eval()
        try:
            for b in range(0, len(requests), cfg.batch_size):
                chunk = list(requests[b : b + cfg.batch_size])
                rows = self._rows(model, tokenizer, chunk, layers, ctx.config, history)
                for n, m in layers.items():
                    H, G = rows[n]
                    d_out, d_in = shapes[n]
                    norms[n].update(torch.cat([H, G], 1))
                    h_hat, g_hat = norms[n](torch.cat([H, G], 1)).split([d_in, d_out], 1)
                    W = weight_matrix(m)
                    V = pseudo_values(h_hat, g_hat, cfg.lr)
                    yield n, ultraedit_delta(H.to(W.device), V.to(W.device), cfg.ridge)
                history.steps += 1
        finally:
            model.train(was_training)

    def carried_state(self, state: dict) -> dict[str, Tensor]:
        """The running normalisation of every layer (``<layer>::n``, ``::mean``, ``::m2``)."""
        return {k: v for n, norm in state["norms"].items() for k, v in norm.to_tensors(n).items()}
