"""K-FAC and eigenvalue-corrected K-FAC (EK-FAC) for small classifiers (linear and conv layers).

Study code (the MNIST curvature study, :mod:`.mnist_study`). K-FAC statistics are gathered with the library's own
pieces (:func:`~crispedit.curvature.statistics.capture_io`,
:func:`~crispedit.curvature.statistics.layer_rows` -- conv inputs as unfolded patches -- and
:class:`~crispedit.curvature.statistics.FactorAccumulator`). Factors are scaled so that ``A (x) S``
approximates the layer's block of the Gauss-Newton matrix of the *mean* loss in the library's
column-major ``vec`` coordinates: for a layer seen by ``T`` rows per example (``T = 1`` for a linear
layer, ``T`` = number of spatial positions for a convolution) ``A = E_rows[a a^T]`` and
``S = T E_rows[sum_c g_c g_c^T]`` (the KFC approximation of Grosse & Martens 2016: positions are
treated as independent and uncorrelated).

Output-gradient modes (:class:`OutputGrads`):

* ``exact``: for every example all ``C`` classes, ``g_c`` backpropagated from
  ``sqrt(p_c) (p - e_c)``; ``sum_c`` then gives the true Fisher = Gauss-Newton for softmax
  cross-entropy, deterministically (``C`` backward passes per batch; fine for 10 classes);
* ``sampled``: one label drawn from the model per example (Monte-Carlo Fisher);
* ``empirical``: the true label (empirical Fisher).

EK-FAC (George et al., 2018) keeps K-FAC's Kronecker eigenbasis ``U_out (x) U_in`` and re-fits one
eigenvalue per basis element as the second moment of the gradient in that basis,
``lambda_ij = E[(U_out^T dW U_in)_ij^2]``. "Per example" is ambiguous for a convolution, whose weight
gradient of one example is a sum over positions ``dW = sum_t g_t a_t^T``:

* ``per="example"`` squares the whole per-example gradient (cross-position terms included): this is
  exactly the diagonal of the true Gauss-Newton block in the Kronecker eigenbasis;
* ``per="row"`` squares each position's ``g_t a_t^T`` separately and sums over positions (the
  diagonal of the KFC "uncorrelated positions" model, the cheap choice of most EK-FAC code).

For linear layers (one row per example) both are the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..curvature.base import Curvature, Eigenbasis
from ..curvature.factors import KFACFactors
from ..curvature.masks import eigh_psd
from ..curvature.statistics import FactorAccumulator, capture_io, frozen
from .mnist_config import OutputGrads

__all__ = [
    "OutputGrads",
    "EKFACFactors",
    "collect_classifier_kfac",
    "ekfac_eigenvalues",
    "collect_classifier_ekfac",
]


@dataclass
class EKFACFactors(Curvature):
    """Per-layer Kronecker eigenbasis and corrected eigenvalues (``d_out x d_in``): a
    :class:`~crispedit.curvature.base.Curvature` whose eigenbasis is K-FAC's and whose eigenvalues are re-fitted."""

    U_out: dict[str, Tensor]
    U_in: dict[str, Tensor]
    eigvals: dict[str, Tensor]
    meta: dict

    @property
    def layers(self) -> list[str]:
        """The layer names, in the order of ``U_in``."""
        return list(self.U_in)

    def eigenbasis(self, name: str, *, device: torch.device | str | None = None) -> Eigenbasis:
        """K-FAC's eigenbasis of layer ``name`` with the corrected eigenvalues (computed at collection)."""
        return Eigenbasis(self.U_out[name], self.U_in[name], self.eigvals[name])

    def merged(self, other: EKFACFactors, weight: float | None = None) -> EKFACFactors:
        """``(1 - weight)`` of these eigenvalues plus ``weight`` of ``other``'s (``None``: equal weights), in the
        shared eigenbasis; ``ValueError`` when the two do not share it (corrected eigenvalues of different bases
        do not average)."""
        if set(self.U_in) != set(other.U_in) or not all(
            torch.equal(self.U_in[n], other.U_in[n]) and torch.equal(self.U_out[n], other.U_out[n]) for n in self.U_in
        ):
            raise ValueError("EK-FAC curvatures merge only in a shared eigenbasis")
        w = 0.5 if weight is None else float(weight)
        return EKFACFactors(
            dict(self.U_out),
            dict(self.U_in),
            {n: (1 - w) * self.eigvals[n] + w * other.eigvals[n] for n in self.eigvals},
            dict(self.meta),
        )


def _output_grads(logits: Tensor, targets: Tensor, mode: OutputGrads, generator: torch.Generator | None) -> Tensor:
    """``K x B x C`` gradients of the per-example loss w.r.t. the logits, one set per backward pass."""
    p = torch.softmax(logits.detach().double(), dim=-1)
    C = p.shape[-1]
    if mode is OutputGrads.EXACT:
        eye = torch.eye(C, dtype=p.dtype, device=p.device)
        # pass c: sqrt(p_c) (p - e_c); sum_c outer products = diag(p) - p p^T
        out = p.sqrt().T.unsqueeze(-1) * (p.unsqueeze(0) - eye.unsqueeze(1))
    else:
        if mode is OutputGrads.SAMPLED:
            y = torch.multinomial(p.float().cpu(), 1, generator=generator).squeeze(-1).to(p.device)
        else:
            y = targets
        out = (p - F.one_hot(y, C).to(p.dtype)).unsqueeze(0)
    return out.to(logits.dtype)


def _run_layers(
    model: nn.Module,
    layers: dict[str, nn.Module],
    x: Tensor,
    y: Tensor,
    mode: OutputGrads,
    generator: torch.Generator | None,
) -> tuple[dict[str, Tensor], dict[str, list[Tensor]]]:
    """One forward with ``layers`` hooked and one backward per output-gradient set.

    Returns per layer the input rows (``B x T x d_in``) and the list of output-gradient rows
    (``B x T x d_out``), each for the per-example (sum-reduced) loss.
    """
    with frozen(model), capture_io(layers) as store:
        logits = model(x)
        seeds = _output_grads(logits, y, mode, generator)
        for k in range(seeds.shape[0]):
            logits.backward(seeds[k], retain_graph=k + 1 < seeds.shape[0])
            # capture_io makes the lowest hooked output a leaf; autograd stores the first gradient
            # it receives as that leaf's .grad and adds later passes into it in place, which would
            # overwrite the recorded tensor: keep a private copy of each pass.
            for name in layers:
                store[name].grads[-1] = store[name].grads[-1].clone()
    inputs, grads = {}, {}
    for name in layers:
        cap = store[name]
        if len(cap.inputs) != 1:
            raise RuntimeError(f"layer {name} was called {len(cap.inputs)} times in one forward")
        a = cap.inputs[0]
        inputs[name] = a if a.dim() == 3 else a.reshape(a.shape[0], 1, -1)
        grads[name] = [g if g.dim() == 3 else g.reshape(g.shape[0], 1, -1) for g in cap.grads]
    return inputs, grads


def _layer_dict(model: nn.Module, names: Iterable[str] | None) -> dict[str, nn.Module]:
    mods = dict(model.named_modules())
    if names is None:
        return {n: m for n, m in mods.items() if isinstance(m, (nn.Linear, nn.Conv2d))}
    missing = [n for n in names if n not in mods]
    if missing:
        raise KeyError(f"unknown layers {missing}")
    return {n: mods[n] for n in names}


def _check_bias_free(layers: dict[str, nn.Module]) -> None:
    for name, m in layers.items():
        if getattr(m, "bias", None) is not None:
            raise ValueError(f"layer {name} has a bias; the classifier K-FAC here models bias-free layers")


def _layer_passes(
    model: nn.Module,
    layers: dict[str, nn.Module],
    batches: Iterable[tuple[Tensor, Tensor]],
    mode: OutputGrads,
    gen: torch.Generator,
):
    """For each ``(inputs, labels)`` of ``batches``: ``(B, layer inputs, output-gradient passes)`` as
    :func:`_run_layers` gives them (``B`` examples), the model in eval mode meanwhile and its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        for x, y in batches:
            inputs, grads = _run_layers(model, layers, x, y, mode, gen)
            yield x.shape[0], inputs, grads
    finally:
        model.train(was_training)


def collect_classifier_kfac(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    layers: Iterable[str] | None = None,
    *,
    mode: OutputGrads | str = OutputGrads.EXACT,
    seed: int = 0,
    stat_dtype: torch.dtype = torch.float64,
) -> KFACFactors:
    """K-FAC factors of the mean cross-entropy of a (bias-free) classifier over ``batches``.

    ``batches`` yields ``(inputs, labels)``; ``layers`` names Linear/Conv2d modules (default: all).
    ``meta["rows_per_example"]`` records ``T`` per layer.
    """
    mode = OutputGrads(mode)
    mods = _layer_dict(model, layers)
    _check_bias_free(mods)
    gen = torch.Generator().manual_seed(seed)
    accA, accS = FactorAccumulator(stat_dtype), FactorAccumulator(stat_dtype)
    rows_per_example: dict[str, int] = {}
    passes = 1
    for _, inputs, grads in _layer_passes(model, mods, batches, mode, gen):
        for name in mods:
            a = inputs[name].reshape(-1, inputs[name].shape[-1])
            g = torch.cat([gk.reshape(-1, gk.shape[-1]) for gk in grads[name]])
            rows_per_example[name] = inputs[name].shape[1]
            passes = len(grads[name])
            # A and S see different row counts (S stacks the backward passes), hence two
            # accumulators; the 1-column partner statistic of each is ignored.
            accA.add(name, a, a[:, :1])
            accS.add(name, g[:, :1], g)
    names = list(mods)
    A = accA.factors(names, out_dtype=torch.float64).A
    S_rows = accS.factors(names, out_dtype=torch.float64).S  # sum / (passes * rows)
    # sum over passes (not mean), times T positions per example (KFC scaling)
    S = {n: S_rows[n] * passes * rows_per_example[n] for n in names}
    n_examples = accA.rows[names[0]] // rows_per_example[names[0]]
    meta = {"mode": mode.value, "seed": seed, "rows_per_example": rows_per_example, "n_examples": n_examples}
    return KFACFactors(A, S, n_examples, meta)


def ekfac_eigenvalues(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    U_out: dict[str, Tensor],
    U_in: dict[str, Tensor],
    *,
    mode: OutputGrads | str = OutputGrads.EXACT,
    per: Literal["example", "row"] = "example",
    seed: int = 0,
) -> dict[str, Tensor]:
    """Corrected eigenvalues ``E_examples[ sum_passes (U_out^T dW U_in)^2 ]`` per layer (``d_out x d_in``).

    ``dW`` is the weight gradient (matrix form ``d_out x d_in``) of one example's loss for one output
    gradient pass; see the module docstring for ``per``. With ``mode="exact"`` the result is the
    diagonal of the Gauss-Newton block in the basis ``U_in (x) U_out`` (``per="example"``).
    """
    mode = OutputGrads(mode)
    if per not in ("example", "row"):
        raise ValueError(f"per must be 'example' or 'row', got {per!r}")
    mods = _layer_dict(model, list(U_in))
    _check_bias_free(mods)
    gen = torch.Generator().manual_seed(seed)
    sums = {n: torch.zeros(U_out[n].shape[1], U_in[n].shape[1], dtype=torch.float64) for n in mods}
    count = 0
    for n_examples, inputs, grads in _layer_passes(model, mods, batches, mode, gen):
        for name in mods:
            dev = inputs[name].device  # (the bases and sums go where the model runs; the result to the CPU)
            sums[name] = sums[name].to(dev)
            a_t = inputs[name].to(torch.float64) @ U_in[name].to(dev, torch.float64)  # B x T x d_in
            for g in grads[name]:
                g_t = g.to(torch.float64) @ U_out[name].to(dev, torch.float64)  # B x T x d_out
                if per == "example" and a_t.shape[1] > 1:
                    dW = torch.einsum("bto,bti->boi", g_t, a_t)
                    sums[name] += (dW * dW).sum(0)
                else:  # one row per example, or rows squared separately
                    sums[name] += torch.einsum("bto,bti->oi", g_t * g_t, a_t * a_t)
        count += n_examples
    return {n: (sums[n] / count).cpu() for n in mods}


def collect_classifier_ekfac(
    model: nn.Module,
    batches,
    layers: Iterable[str] | None = None,
    *,
    mode: OutputGrads | str = OutputGrads.EXACT,
    per: Literal["example", "row"] = "example",
    seed: int = 0,
    factors: KFACFactors | None = None,
) -> EKFACFactors:
    """K-FAC eigenbasis (from ``factors``, collected if not given) plus corrected eigenvalues.

    ``batches`` must be re-iterable (a list) when ``factors`` is None: it is read twice.
    """
    if factors is None:
        factors = collect_classifier_kfac(model, batches, layers, mode=mode, seed=seed)
    U_out, U_in = {}, {}
    for name in factors.layers:
        U_in[name] = eigh_psd(factors.A[name])[1]
        U_out[name] = eigh_psd(factors.S[name])[1]
    eig = ekfac_eigenvalues(model, batches, U_out, U_in, mode=mode, per=per, seed=seed)
    return EKFACFactors(U_out, U_in, eig, {"mode": OutputGrads(mode).value, "per": per, "seed": seed})
