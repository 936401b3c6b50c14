"""Predicted KL drift of a weight change from K-FAC factors, and the drift budget that enforces it.

With sampled labels the capability factors approximate the Fisher of the model's own predictive
distribution per token (:mod:`.kfac`: ``A = E[a aᵀ]``, ``S = E[g gᵀ]`` with ``g`` the gradient of one
token's loss, divided by the number of tokens). To second order, the mean per-token
KL(base ‖ edited) of a change ``ΔW`` (``d_out x d_in``) of a linear layer is then

    ½ · vec(ΔW)ᵀ (A ⊗ S) vec(ΔW) = ½ · tr(ΔWᵀ S ΔW A)    (column-major vec)

per edited layer. K-FAC is block-diagonal: it drops the cross-layer terms ``vec(ΔW_l)ᵀ F_lm vec(ΔW_m)``. An
edit changes its layers *coherently* (every layer pushes the same residual stream towards the same
target), so those terms are not small: the block-diagonal sum ``Σ_l q_l`` underestimates the measured
drift of an edit over several layers (the figures: docs/drift.md, "Predicted drift").
By Cauchy–Schwarz in the Fisher inner
product, ``vec(ΔW)ᵀ F vec(ΔW) ≤ (Σ_l sqrt(vec(ΔW_l)ᵀ F_ll vec(ΔW_l)))²``, so the *coherent* bound

    kl_predicted = (Σ_l sqrt(q_l))²,   q_l = ½ · tr(ΔW_lᵀ S_l ΔW_l A_l)

is what :func:`predicted_kl` reports as ``total`` (and what the budget enforces): the second-order drift
with the layers' effects fully aligned. ``blockdiag`` (``Σ_l q_l``) is the fully independent case; the truth
of the quadratic model lies between the two (equal for one layer). Compare both with the measured
:func:`crispedit.evaluation.drift.kl_drift` (mean over tokens, nats) on other text.

:class:`DriftBudget` is the trust region of ``--max-drift``: after every optimizer step it scales the
accumulated change of all layers by one factor ``sqrt(eps / predicted)`` whenever the predicted drift
exceeds ``eps`` (the form is quadratic, so the scaled change predicts exactly ``eps``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..layers import as_weight_matrix

__all__ = [
    "layer_predicted_kl",
    "coherent_total",
    "predicted_kl",
    "DriftBudget",
    "LowRankDriftBudget",
    "steep_layers",
    "steep_note",
    "mixing_layers",
    "mixing_note",
    "prediction_notes",
]


def layer_predicted_kl(dW: Tensor, A: Tensor, S: Tensor, dtype: torch.dtype = torch.float64) -> float:
    """``½ tr(ΔWᵀ S ΔW A)`` (nats per token) for one layer: ``dW`` ``d_out x d_in``, ``A`` ``d_in x d_in``,
    ``S`` ``d_out x d_out`` (symmetric), computed in ``dtype`` (float64 by default) on ``dW``'s device."""
    if dW.shape != (S.shape[0], A.shape[0]):
        raise ValueError(
            f"change of shape {tuple(dW.shape)} does not match factors A {tuple(A.shape)}, S {tuple(S.shape)}"
        )
    d = dW.to(dtype)
    SA = (S.to(device=d.device, dtype=dtype) @ d) * (d @ A.to(device=d.device, dtype=dtype))
    return 0.5 * float(SA.sum())


def coherent_total(per_layer) -> float:
    """``(Σ_l sqrt(q_l))²`` for per-layer predictions ``q_l >= 0`` (an iterable of floats): the quadratic drift
    model's value when the layers' effects are aligned (Cauchy–Schwarz upper bound of the full form;
    ``Σ_l q_l`` is the block-diagonal lower case). 0.0 for no layers."""
    return sum(math.sqrt(max(float(q), 0.0)) for q in per_layer) ** 2


def predicted_kl(
    layers: Mapping[str, nn.Module], factors, before: Mapping[str, Tensor], after: Mapping[str, Tensor] | None = None
) -> dict | None:
    """Predicted per-token KL drift of the change ``after - before`` of the edit layers' weights.

    ``layers``: module name -> linear module; ``factors``: a :class:`~.base.Curvature` keyed by module name (the
    capability :class:`~.factors.KFACFactors`); ``before`` / ``after``: full parameter name -> tensor (``after``
    defaults to the modules' current weights). A layer counts when its ``<name>.weight`` is in ``before`` and the
    curvature covers it (:meth:`~.base.Curvature.covers`); its prediction is the curvature's quadratic form of the
    change in float64 (:meth:`~.base.Curvature.quadratic_form`). Returns ``{"total": float, "blockdiag": float,
    "layers": {module name: float}}`` (nats per token; ``total`` the coherent bound :func:`coherent_total`,
    ``blockdiag`` the sum of the layers) or ``None`` when no changed weight is covered (e.g. LoRA's q/v
    projections, input statistics without ``S``, or no factors)."""
    if factors is None:
        return None
    out: dict[str, float] = {}
    for name, module in layers.items():
        key = f"{name}.weight"
        if key not in before or not factors.covers(name):
            continue
        w1 = (after[key] if after is not None else module.weight).detach()
        w0 = before[key].detach().to(w1.device)
        dW = as_weight_matrix(module, w1.double() - w0.double())
        out[name] = factors.quadratic_form(name, dW)
    if not out:
        return None
    return {"total": coherent_total(out.values()), "blockdiag": sum(out.values()), "layers": out}


class DriftBudget:
    """Trust region on the predicted drift of the accumulated change of ``params`` since construction.

    ``params``: name -> trained weight (module name keys, as the loop trains them); ``modules``: name ->
    its module (storage orientation); ``factors``: a :class:`~.base.Curvature` covering every name (the
    capability K-FAC factors); ``eps``: the budget in
    nats per token. :meth:`enforce` (after each optimizer step) computes the coherent bound
    ``p = (Σ_l sqrt(q_l))²``, ``q_l = ½ tr(ΔW_lᵀ S_l ΔW_l A_l)``, in float32 on the weights' device and, when
    ``p > eps``, sets ``W = W0 + sqrt(eps / p) · ΔW`` for every layer (``p`` is quadratic in ΔW). ``hits`` counts the
    steps that were pulled back; ``last`` is the latest predicted drift
    (after the pull-back). ``eps=None``: no pull-back.

    ``penalty`` (β ≥ 0, ``--drift-penalty``) is the soft, Lagrangian side of the same constraint:
    :meth:`add_penalty_gradient` (between backward and projection) adds ``β · ∂p/∂ΔW_l`` to every layer's
    gradient, ``∂p/∂ΔW_l = (sqrt(p) / sqrt(q_l)) · S_l ΔW_l A_l``, so training minimises
    ``edit loss + β · predicted drift`` (nats per target token + β · nats per held-out token): among the
    changes that make the edit, the ones the capability curvature says are flattest. ``reference`` (name ->
    weight, storage orientation): the weights the penalty measures the change from instead of the starting ones —
    a session's base, so that a round pays for the drift the whole session has made and may take back what
    earlier rounds left in the directions it may move; the budget still measures from the start.

    The factors are the capability factors of the changed layers whatever the method: a curvature method's
    own, those ``--predict-drift`` fetches for ft and locbf-ft, and for LoRA those of the adapted modules
    (:class:`LowRankDriftBudget`). The prediction is second order: it reads small changes well and
    under-reads large ones (docs/drift.md), so a budget holds the measured drift only as
    well as the prediction reads it."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        modules: Mapping[str, nn.Module],
        factors,
        eps: float | None,
        penalty: float = 0.0,
        reference: Mapping[str, Tensor] | None = None,
    ):
        self.params, self.modules = dict(params), dict(modules)
        self._setup(factors, {n: p.device for n, p in self.params.items()}, eps, penalty)
        self.start = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.reference = self.start
        if reference is not None:
            missing = sorted(set(self.params) - set(reference))
            if missing:
                raise ValueError(f"the drift penalty's reference weights lack {missing}")
            self.reference = {
                n: reference[n].detach().to(device=p.device, dtype=torch.float32) for n, p in self.params.items()
            }

    def _setup(self, factors, devices: Mapping[str, torch.device], eps: float | None, penalty: float) -> None:
        """The budget, the penalty, the counters and the curvature of each layer (float32, on ``devices[name]``:
        :meth:`~.base.Curvature.on`)."""
        missing = [n for n in devices if not factors.covers(n)]
        if missing:
            raise ValueError(f"the drift budget has no K-FAC factors for {missing}")
        self.eps = None if eps is None else float(eps)
        self.penalty = float(penalty)
        self.curvature = factors.on(devices, torch.float32)
        self.hits = 0
        self.last = 0.0
        self.steps = 0

    def deltas(self) -> dict[str, Tensor]:
        """The accumulated change of every parameter, as stored (float32)."""
        return {n: p.detach().float() - self.start[n] for n, p in self.params.items()}

    def penalty_deltas(self) -> dict[str, Tensor]:
        """The change the penalty reads: every parameter's from :attr:`reference` (float32)."""
        if self.reference is self.start:
            return self.deltas()
        return {n: p.detach().float() - self.reference[n] for n, p in self.params.items()}

    def predicted(self, deltas: Mapping[str, Tensor] | None = None) -> float:
        """Predicted drift (nats per token) of ``deltas`` (default: the current accumulated change)."""
        deltas = self.deltas() if deltas is None else deltas
        return coherent_total(
            self.curvature.quadratic_form(n, as_weight_matrix(self.modules[n], d), torch.float32)
            for n, d in deltas.items()
        )

    def _pull_back(self, c: float, deltas: Mapping[str, Tensor]) -> None:
        """Scale every layer's accumulated change by ``c``: ``W = W0 + c · ΔW``."""
        for n, param in self.params.items():
            param.copy_((self.start[n] + c * deltas[n]).to(param.dtype))

    @torch.no_grad()
    def enforce(self) -> bool:
        """Pull the accumulated change back onto the budget when its predicted drift exceeds ``eps``;
        returns whether it did."""
        self.steps += 1
        deltas = self.deltas()
        p = self.predicted(deltas)
        if self.eps is None or not math.isfinite(p) or p <= self.eps:
            self.last = p
            return False
        self._pull_back(math.sqrt(self.eps / p), deltas)
        self.hits += 1
        self.last = self.eps
        return True

    def _drift_gradients(self) -> tuple[float, dict[str, Tensor]]:
        """The coherent predicted drift ``p`` of the change from :attr:`reference` (the start by default) and
        ``∂p/∂ΔW_l`` of every layer with a change (``d_out x d_in``, float32; a layer with ``q_l = 0`` is left out:
        its term is 0)."""
        qs, SdA = {}, {}
        for n, d in self.penalty_deltas().items():
            dW = as_weight_matrix(self.modules[n], d)
            SdA[n] = self.curvature.matvec(n, dW)
            qs[n] = 0.5 * float((dW * SdA[n]).sum())
        total = coherent_total(qs.values())
        root = math.sqrt(total)
        return total, {n: SdA[n] * (root / math.sqrt(qs[n])) for n in qs if qs[n] > 0}

    def _add_gradients(self, grads: Mapping[str, Tensor]) -> None:
        """Add ``penalty · grads[l]`` (``∂p/∂ΔW_l``) to the gradient of each layer's weight (storage orientation)."""
        for n, g in grads.items():
            param = self.params[n]
            if param.grad is not None:
                param.grad.add_((as_weight_matrix(self.modules[n], g) * self.penalty).to(param.grad.dtype))

    @torch.no_grad()
    def add_penalty_gradient(self) -> float:
        """Add ``penalty · ∂p/∂W`` (the coherent predicted drift ``p`` of the change from :attr:`reference`, see the
        class docstring) to every parameter's ``.grad`` in place; returns ``p`` (nats per token). A layer with no
        change yet (``q_l = 0``) gets nothing (its gradient term is 0)."""
        if self.penalty <= 0:
            return 0.0
        total, grads = self._drift_gradients()
        self._add_gradients(grads)
        return total

    def to_json(self) -> dict:
        """What the budget did: ``max_drift``, ``hit`` (ever pulled back), ``hits`` (steps pulled back),
        ``steps`` checked, ``final_predicted`` (nats per token, float32 estimate) and ``drift_penalty`` (β)."""
        return {
            "max_drift": self.eps,
            "hit": self.hits > 0,
            "hits": self.hits,
            "steps": self.steps,
            "final_predicted": self.last,
            "drift_penalty": self.penalty,
        }


class LowRankDriftBudget(DriftBudget):
    """:class:`DriftBudget` on merged low-rank updates (LoRA): layer ``l`` changes by ``ΔW_l = s_l · B_l A_l``
    (``A_l`` ``r x d_in``, ``B_l`` ``d_out x r``, ``s_l = alpha / r``), what merging the adapter adds to the
    base weight. ``adapters``: name -> ``(A_l, B_l, s_l)``, the trained adapter matrices of the module
    ``modules[name]`` (a linear layer: ``d_out x d_in`` orientation); ``factors`` cover every name.

    The change is measured from ``B = 0`` (peft's initialisation: a fresh adapter is no change), so the pull
    back is exact: scaling every ``B_l`` by ``c`` scales every ``ΔW_l`` by ``c``. The penalty's gradient is
    the chain rule through the product, ``∂p/∂B_l = s_l · G_l A_lᵀ``, ``∂p/∂A_l = s_l · B_lᵀ G_l`` with
    ``G_l = ∂p/∂ΔW_l``."""

    def __init__(
        self,
        adapters: Mapping[str, tuple[nn.Parameter, nn.Parameter, float]],
        modules: Mapping[str, nn.Module],
        factors,
        eps: float | None,
        penalty: float = 0.0,
    ):
        self.adapters = {n: (a, b, float(s)) for n, (a, b, s) in adapters.items()}
        self.modules = dict(modules)
        self.params = {}
        self._setup(factors, {n: b.device for n, (_, b, _) in self.adapters.items()}, eps, penalty)

    def deltas(self) -> dict[str, Tensor]:
        """The merged update ``s · B A`` of every adapter (``d_out x d_in``, float32)."""
        return {n: s * (b.detach().float() @ a.detach().float()) for n, (a, b, s) in self.adapters.items()}

    def penalty_deltas(self) -> dict[str, Tensor]:
        """The penalty reads the merged update: a fresh adapter has no reference but its own zero."""
        return self.deltas()

    def _pull_back(self, c: float, deltas: Mapping[str, Tensor]) -> None:
        """Scale every merged update by ``c`` through its ``B``."""
        for _, b, _ in self.adapters.values():
            b.copy_((c * b.detach().float()).to(b.dtype))

    def _add_gradients(self, grads: Mapping[str, Tensor]) -> None:
        """Add ``penalty`` times the chain rule of ``grads[l]`` (``∂p/∂ΔW_l``) through ``s · B A`` to ``A.grad``
        and ``B.grad``."""
        for n, g in grads.items():
            a, b, s = self.adapters[n]
            af, bf = a.detach().float(), b.detach().float()
            if b.grad is not None:
                b.grad.add_((self.penalty * s * (g @ af.T)).to(b.grad.dtype))
            if a.grad is not None:
                a.grad.add_((self.penalty * s * (bf.T @ g)).to(a.grad.dtype))


STEEP_FACTOR = 10.0  # a layer predicting this many times the other layers' median ...
STEEP_SHARE = 0.25  # ... and at least this share of the layers' summed predicted drift is "steep"


def steep_layers(layers: dict[str, float], *, factor: float = STEEP_FACTOR, share: float = STEEP_SHARE) -> list[dict]:
    """The edit layers whose own predicted drift ``q_l`` (nats/token, :func:`predicted_kl`'s ``layers``)
    dominates: ``q_l`` above ``factor`` × the median of the other layers and at least ``share`` of ``Σ q``.
    Each as ``{"layer", "predicted", "share", "vs_median"}``, largest first; ``[]`` with fewer than two layers.
    A window holding such a layer drifts far more than one without it (docs/cli.md, 'Choosing layers'), so an edit
    window
    without it is worth trying. Edit reports, compare rows and session rounds record them."""
    vals = {k: float(v) for k, v in layers.items()}
    total = sum(vals.values())
    if len(vals) < 2 or not total > 0:
        return []
    out = []
    for name, q in vals.items():
        med = statistics.median(v for k, v in vals.items() if k != name)
        if q >= share * total and q > factor * med:
            out.append(
                {
                    "layer": name,
                    "predicted": float(f"{q:.6g}"),
                    "share": round(q / total, 4),
                    "vs_median": None if med <= 0 else round(q / med, 1),
                }
            )
    return sorted(out, key=lambda d: -d["predicted"])


def steep_note(st: dict) -> str:
    """One line on a steep layer (an entry of :func:`steep_layers`): its share of the predicted drift, the
    prediction in nats/token, its ratio to the other layers' median, and the advice to edit without it."""
    times = "" if st.get("vs_median") is None else f", {st['vs_median']:g}x the other layers' median"
    return (
        f"{st['layer']} predicts {st['share']:.0%} of the drift ({st['predicted']:.3g} nats/token{times}); "
        "an edit without this layer may drift far less (see docs/cli.md, 'Choosing layers')"
    )


# Last name component of the matrices whose outputs attention mixes across positions (query / key / value
# projections of llama-, gemma-, GPT-2- and GPT-NeoX-style blocks).
MIXING_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv", "query", "key", "value"}
)


def mixing_layers(names) -> list[str]:
    """The edit layers (module names, e.g. ``model.layers.4.self_attn.v_proj``) whose outputs attention mixes
    across positions: query, key and value projections (:data:`MIXING_NAMES`), in the given order.

    K-FAC treats every position as an independent row of the layer, so on these matrices the predicted drift
    misses what a change does to *other* positions, while layers that act after the mixing (``o_proj``,
    ``down_proj``) are predicted well (docs/cli.md, 'Choosing layers'). The prediction, ``--max-drift``
    and ``--drift-penalty`` are not to be trusted there."""
    return [n for n in names if str(n).rsplit(".", 1)[-1] in MIXING_NAMES]


def mixing_note(layers: list[str]) -> str:
    """One line on :func:`mixing_layers`: which edit layers the drift prediction under-reads, and why."""
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return (
        f"{shown}: attention mixes these outputs across positions, which the K-FAC drift prediction does not "
        "model; kl_predicted, --max-drift and --drift-penalty "
        "under-read it here (see docs/cli.md, 'Choosing layers')"
    )


def prediction_notes(summary: Mapping) -> list[str]:
    """The one-line notes on a drift prediction, from an edit report's ``summary`` (or a session round's
    record): one :func:`steep_note` per ``steep_layers`` entry, then a :func:`mixing_note` when
    ``mixing_layers`` is non-empty. ``crispedit edit``, ``session status`` and ``compare.md`` print these."""
    notes = [steep_note(st) for st in summary.get("steep_layers") or []]
    if summary.get("mixing_layers"):
        notes.append(mixing_note(list(summary["mixing_layers"])))
    return notes
