"""Meta-training of MEND's gradient-transform network (:mod:`.net`).

One step (Mitchell et al. 2022, Alg. 1, with the authors' losses): take ``batch_size`` training requests;
compute their factors ``(u, δ)`` on the base model (:func:`~.net.edit_factors`) and, through the network,
the updates ``ΔW_l`` (the running normalisation takes the new rows first); run the model with ``W + ΔW``
(forward hooks, the base weights untouched) and minimise

    L = c_edit · NLL(target | prompt and rephrasings, edited)  +  c_loc · KL(base ‖ edited) on locality text

with Adam on the network (lr ``lr``) and on the per-layer steps ``α`` (lr ``lr_lr``), gradients clipped to
norm ``grad_clip``. The NLL is the mean over target tokens; the KL the mean over every token of the
locality batch: each request's own locality prompts with their answers and ``loc_texts`` passages of the
capability corpus (at most ``loc_len`` tokens each), drawn per step. Requests are drawn without
replacement, epoch after epoch, by a generator seeded with ``seed``.

The training requests must be disjoint from the ones the edited model is evaluated on: ``crispedit mend
train`` defaults to ZsRE dev records 1000–1999 (the evaluation uses 100–199, tuning 400–431).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...curvature.statistics import frozen
from ...data.edits import EditRequest
from ...data.tokenize import collate
from ...errors import CrispEditError
from ...layers import weight_matrix
from . import MENDTrainConfig
from .net import MENDNetwork, added_deltas, edit_factors, request_nll

__all__ = ["MENDTrainHistory", "train_mend", "meta_loss", "locality_batches"]


@dataclass
class MENDTrainHistory:
    """What :func:`train_mend` did: per step the total meta-loss, the edit NLL (nats/target token, after the
    edit) and the locality KL (nats/token); the final per-layer steps ``alpha``; wall seconds; whether the
    time budget stopped it before ``config.steps``."""

    loss: list[float] = field(default_factory=list)
    edit_nll: list[float] = field(default_factory=list)
    loc_kl: list[float] = field(default_factory=list)
    alpha: list[float] = field(default_factory=list)
    seconds: float = 0.0
    stopped_early: bool = False

    def to_json(self) -> dict:
        """JSON-ready summary: steps, seconds, whether the time budget stopped it, first/last-10 means of each
        loss, final α, and ``curve``: every step's loss, edit NLL and locality KL (5 significant digits), so a
        saved network keeps its training curve."""

        def ends(xs):
            """``{"first10", "last10"}``: means of the first / last ten values of ``xs`` (6 decimals); ``{}`` if
            empty."""
            return (
                {
                    "first10": round(sum(xs[:10]) / max(len(xs[:10]), 1), 6),
                    "last10": round(sum(xs[-10:]) / max(len(xs[-10:]), 1), 6),
                }
                if xs
                else {}
            )

        return {
            "steps": len(self.loss),
            "seconds": round(self.seconds, 2),
            "stopped_early": self.stopped_early,
            "loss": ends(self.loss),
            "edit_nll": ends(self.edit_nll),
            "loc_kl": ends(self.loc_kl),
            "alpha": self.alpha,
            "curve": {k: [float(f"{x:.5g}") for x in getattr(self, k)] for k in ("loss", "edit_nll", "loc_kl")},
        }


def locality_batches(tokenizer, requests: Sequence[EditRequest], passages: Sequence[str], loc_len: int, device) -> list:
    """Token batches for the locality KL: one of each request's locality ``prompt + " " + answer`` and one of
    the passages, each cut to its first ``loc_len`` tokens (two batches, so the short prompts are not padded to
    the passages' length); right-padded :class:`~crispedit.data.tokenize.EncodedBatch` es (only ids and mask
    are used), none for an empty group."""
    groups = ([f"{p} {a}" for r in requests for p, a in r.locality], list(passages))
    out = []
    for texts in groups:
        rows = [(ids, 1) for ids in (tokenizer(t)["input_ids"][:loc_len] for t in texts) if len(ids) >= 2]
        if rows:
            out.append(collate(tokenizer, rows, max_len=10**6).to(device))
    return out


def _kl_sum(base_logits: Tensor, logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over the positions of ``mask`` of ``KL(p_base ‖ p_edited)`` (nats) and the number of positions."""
    lb = torch.log_softmax(base_logits.float(), -1)
    le = torch.log_softmax(logits.float(), -1)
    kl = (lb.exp() * (lb - le)).sum(-1)
    m = mask.to(kl.dtype)
    return (kl * m).sum(), m.sum()


def _step(
    net: MENDNetwork,
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    requests: Sequence[EditRequest],
    passages: Sequence[str],
    update_stats: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(meta-loss, edit NLL, locality KL)`` of one batch (module docstring), differentiable in ``net``."""
    cfg = net.config
    device = next(model.parameters()).device
    factors = edit_factors(model, tokenizer, requests, layers)
    deltas = {
        n: net.delta(n, U, D, update=update_stats).to(weight_matrix(layers[n]).device) for n, (U, D) in factors.items()
    }
    locs = locality_batches(tokenizer, requests, passages, cfg.loc_len, device) if cfg.c_loc > 0 else []
    with torch.no_grad():
        base = [model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits for b in locs]
    with added_deltas(layers, deltas):
        nll = request_nll(model, tokenizer, requests, prompts="both")
        total, count = torch.zeros((), device=device), torch.zeros((), device=device)
        for b, base_logits in zip(locs, base):
            s_, c_ = _kl_sum(
                base_logits, model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits, b.attention_mask
            )
            total, count = total + s_, count + c_
        kl = total / count.clamp_min(1)
    return cfg.c_edit * nll + cfg.c_loc * kl, nll, kl


def meta_loss(
    net: MENDNetwork,
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    requests: Sequence[EditRequest],
    passages: Sequence[str] = (),
) -> dict[str, float]:
    """The meta-loss of ``requests`` (one batch) under ``net`` without training anything (statistics frozen):
    ``{"loss", "edit_nll", "loc_kl"}``."""
    with torch.no_grad():
        loss, nll, kl = _step(net, model, tokenizer, layers, requests, passages, update_stats=False)
    return {"loss": float(loss), "edit_nll": float(nll), "loc_kl": float(kl)}


def train_mend(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    layers: dict[str, nn.Module],
    config: MENDTrainConfig | None = None,
    *,
    passages: Sequence[str] = (),
    net: MENDNetwork | None = None,
    max_seconds: float | None = None,
    progress: bool | None = None,
) -> tuple[MENDNetwork, MENDTrainHistory]:
    """Meta-train MEND for ``layers`` (name -> linear module of ``model``) on ``requests`` for ``config.steps``
    steps (module docstring); ``passages``: the capability texts locality passages are drawn from. Continues
    ``net`` when given (its settings win, except ``steps`` and ``seed``, taken from ``config`` when it is given;
    Adam's moments start afresh), else starts an identity network. ``max_seconds``: a wall-clock budget — no
    step starts that would, at the last step's pace, end past it (at least one step runs); the history says
    whether it stopped early. The model is left unchanged. Returns the network (on the model's device) and the
    :class:`MENDTrainHistory`."""
    if not requests:
        raise CrispEditError("no MEND training requests given")
    if max_seconds is not None and not max_seconds > 0:
        raise CrispEditError(f"the MEND training time budget must be positive, got {max_seconds} s")
    if net is not None:
        if config is not None:
            net.config = replace(net.config, steps=config.steps, seed=config.seed).validate()
        config = net.config
    else:
        config = (config or MENDTrainConfig()).validate()
    device = next(model.parameters()).device
    shapes = {n: tuple(weight_matrix(m).shape) for n, m in layers.items()}
    net = net if net is not None else MENDNetwork(shapes, config)
    if net.shapes != shapes or net.layer_names != list(layers):
        raise CrispEditError(f"MEND network was built for layers {net.layer_names}, not {list(layers)}")
    net.to(device)
    opt = torch.optim.Adam(
        [
            {"params": [p for n, p in net.named_parameters() if n != "alpha"], "lr": config.lr},
            {"params": [net.alpha], "lr": config.lr_lr},
        ]
    )
    gen = torch.Generator().manual_seed(config.seed)
    hist, t0 = MENDTrainHistory(), time.perf_counter()
    bar = tqdm(range(config.steps), desc="mend train", unit="step", disable=None if progress is None else not progress)
    with frozen(model):  # only the network and α train
        _loop(net, model, tokenizer, layers, requests, passages, config, opt, gen, bar, hist, t0, max_seconds)
    hist.alpha = [round(float(a), 8) for a in net.alpha.detach().cpu()]
    hist.seconds = time.perf_counter() - t0
    return net, hist


def _loop(net, model, tokenizer, layers, requests, passages, config, opt, gen, bar, hist, t0, max_seconds) -> None:
    """The steps of :func:`train_mend` (the model frozen by the caller), stopping before a step that would end
    past ``t0 + max_seconds`` at the previous step's pace."""
    order: list[int] = []
    last = 0.0
    for _ in bar:
        start = time.perf_counter()
        if max_seconds is not None and hist.loss and start + last - t0 > max_seconds:
            hist.stopped_early = True
            break
        while len(order) < config.batch_size:
            order += torch.randperm(len(requests), generator=gen).tolist()
        idx, order = order[: config.batch_size], order[config.batch_size :]
        chunk = [requests[i] for i in idx]
        picks = torch.randint(len(passages), (config.loc_texts,), generator=gen).tolist() if passages else []
        loss, nll, kl = _step(net, model, tokenizer, layers, chunk, [passages[i] for i in picks], update_stats=True)
        if not torch.isfinite(loss):
            raise CrispEditError(
                f"the MEND meta-loss became {float(loss)} at step {len(hist.loss) + 1}; "
                "lower --lr / --edit-lr — nothing was saved"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), config.grad_clip)
        opt.step()
        hist.loss.append(loss.item())
        hist.edit_nll.append(nll.item())
        hist.loc_kl.append(kl.item())
        bar.set_postfix(loss=f"{hist.loss[-1]:.4f}", nll=f"{hist.edit_nll[-1]:.3f}", kl=f"{hist.loc_kl[-1]:.4f}")
        last = time.perf_counter() - start
    bar.close()
