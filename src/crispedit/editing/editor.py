"""The editor interface and the set-up around the projected loop, written once.

An editor answers: which layers it edits (:meth:`Editor.select_layers`), which base-model parameters
its edit changes (:meth:`Editor.changes`: what callers snapshot and restore), and how it edits
(:meth:`Editor.apply`). The default ``apply`` is the shared projected fine-tuning loop
(:func:`crispedit.editing.loop.projected_finetune`) on :meth:`Editor.trainable` under
:meth:`Editor.projectors`; a fine-tuning editor overrides only those two questions. The single-pass
editors (MEMIT, AlphaEdit, UltraEdit, MEND) share the ``apply`` of :class:`~.single_pass.SinglePassEditor`
and compute only their weight changes; an adapter editor overrides ``apply`` itself (see
``methods/lora.py``). The editors themselves are the methods of :mod:`crispedit.methods`.

Torch-free at import (torch and the loop are imported inside the methods that run them), so that a
method module that subclasses :class:`Editor` can be read by the method catalogue — which the command
line's ``--help`` and argument checks need — without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CrispEditError
from ..paths import file_digest
from .config import EditConfig
from .registry import MethodConfig

if TYPE_CHECKING:  # annotations only: importing them here would import torch
    from torch import Tensor, nn

    from ..curvature.factors import KFACFactors
    from ..curvature.projection import LayerProjector
    from ..data.edits import EditRequest
    from .history import TrainHistory

__all__ = ["Editor", "EditContext", "EditOutcome", "identity_projectors"]


@dataclass
class EditContext:
    """Everything :meth:`Editor.apply` needs besides model, tokenizer and requests.

    ``layers``: the edit layers (module name -> linear module) from :meth:`Editor.select_layers`;
    ``factors``: the K-FAC constraint for curvature editors (capability, or capability + earlier
    edits in a session); ``optimizer_state``: a flattened Adam state to continue from (sessions;
    :func:`..optim.optimizer_state` format) whose first moment is re-projected onto the new kept
    subspace when ``reproject_momentum``; ``keep_optimizer``: return the final Adam state. For an editor
    with ``carries_state`` (AlphaEdit) ``optimizer_state`` is its own carried state instead.
    ``drift_factors``: the capability factors the ``config.max_drift`` budget is measured with (default:
    ``factors``; sessions pass the capability factors alone, without the earlier edits'). ``drift_reference``: the
    weights ``config.drift_penalty`` measures the change from (full parameter name -> tensor; default: the weights
    the edit starts from; a sequential session's base under ``--drift-from base``). ``checkpoint``: a file
    the fine-tuning loop saves its state to and resumes from (:mod:`crispedit.editing.checkpoint`); editors
    that do not run the loop on fixed starting weights ignore it."""

    config: EditConfig
    layers: dict[str, nn.Module]
    factors: KFACFactors | None = None
    drift_factors: KFACFactors | None = None
    drift_reference: dict[str, Tensor] | None = None
    optimizer_state: dict[str, Tensor] = field(default_factory=dict)
    reproject_momentum: bool = True
    keep_optimizer: bool = False
    progress: bool | None = None
    checkpoint: Path | None = None


@dataclass
class EditOutcome:
    """What :meth:`Editor.apply` did: the loop's :class:`TrainHistory`, per-trained-tensor projector
    stats (:meth:`LayerProjector.stats`: ``kept_fraction``; for Kronecker projectors also ``r_out``,
    ``r_in``, ``form`` and ``flop_ratio``), the final flattened Adam state (when asked for) and whether
    a given one was continued, and what the ``--max-drift`` budget did (:meth:`DriftBudget.to_json`; ``None``
    without a budget)."""

    history: TrainHistory
    projector_stats: dict[str, dict] = field(default_factory=dict)
    optimizer_state: dict[str, Tensor] = field(default_factory=dict)
    optimizer_carried: bool = False
    drift_budget: dict | None = None


def identity_projectors(modules: dict[str, nn.Module]) -> dict[str, LayerProjector]:
    """No projection: one :class:`IdentityProjector` of each module's ``d_out x d_in`` weight shape."""
    from ..curvature.projection import IdentityProjector
    from ..layers import weight_matrix

    return {name: IdentityProjector(*weight_matrix(m).shape) for name, m in modules.items()}


class Editor:
    """Base editor: plain fine-tuning of the weight of every edit layer through the projected loop.

    Class attributes: ``name`` (the ``--method`` value), ``summary`` (one line for help texts),
    ``needs_curvature`` (capability statistics are collected for the edit layers and passed as
    ``ctx.factors``), ``curvature_kind`` (which: ``kfac`` = K-FAC ``A`` and ``S``; ``input`` = the input
    covariance ``A`` alone, for the closed-form editors),
    ``carries_optimizer`` (a session may continue Adam's state across rounds), ``carries_state`` (the
    editor's own state — AlphaEdit's accumulated keys — goes from round to round through
    ``ctx.optimizer_state`` / ``EditOutcome.optimizer_state`` whatever ``carry_optimizer`` says), ``base_only``
    (what the editor applies was learned for the unedited model — MEND's network — so no sequential session takes
    it: a later round would edit an edited model), ``Config`` (the
    method's own :class:`MethodConfig` dataclass). A built-in editor sets only ``name`` (and its
    behaviour): ``summary`` and ``Config`` come from its method's ``METHOD`` entry (:mod:`crispedit.methods`)
    when :func:`~crispedit.editing.registry.editor_class` loads it."""

    name = "base"
    summary = ""
    needs_curvature = False
    curvature_kind = "kfac"
    carries_optimizer = True
    carries_state = False
    base_only = False
    Config: type[MethodConfig] = MethodConfig

    def check_requests(self, requests: Sequence[EditRequest]) -> None:
        """One-line :class:`CrispEditError` when a request lacks what this editor needs (default: nothing
        beyond prompt and target); :func:`~crispedit.editing.edit` calls it before any other work."""

    def check_ready(self, model: nn.Module, config: EditConfig) -> None:
        """One-line :class:`CrispEditError` when this editor cannot run on ``model`` under ``config`` for a reason
        other than the requests (MEND: no trained network for this model and layers); ``compare`` calls it for
        every method before running any. Default: nothing."""

    def input_files(self, model: nn.Module, config: EditConfig) -> dict[str, Path]:
        """The files this run reads besides the model, the requests and the curvature cache, keyed by the method
        option that names them (MEND: ``weights`` -> its network file, the default cache file when the option is
        empty). ``compare`` identifies a stored row by these files' content, not their paths. Default: none."""
        return {}

    def input_digests(self, model: nn.Module, config: EditConfig) -> dict[str, str]:
        """:meth:`input_files` by content: option -> SHA-256 (64 hex) of the file; what an edit report and a
        compare row record, so that a result names the network that made it wherever the file lies."""
        return {opt: file_digest(f, f"{self.name} {opt} file") for opt, f in self.input_files(model, config).items()}

    def select_layers(self, model: nn.Module, config: EditConfig) -> dict[str, nn.Module]:
        """The edit layers (module name -> linear module): ``config.layers`` or the per-architecture default."""
        from ..layers import resolve_layers

        return resolve_layers(model, config.layers)

    def trainable(self, layers: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
        """The parameters the loop trains, keyed like ``layers`` (module name -> weight, ``d_out x d_in``
        or transposed for Conv1D)."""
        return {name: m.weight for name, m in layers.items()}

    def projectors(
        self, layers: dict[str, nn.Module], factors: KFACFactors | None, config: EditConfig
    ) -> dict[str, LayerProjector]:
        """One projector per trained tensor (keyed like :meth:`trainable`); default: the identity."""
        return identity_projectors(layers)

    def changes(self, model: nn.Module, layers: dict[str, nn.Module], config: EditConfig) -> dict[str, nn.Parameter]:
        """The base-model parameters whose values :meth:`apply` changes, by full parameter name
        (``model.get_parameter(name)``): what callers snapshot before, restore after, and what a
        session stores. Default: the trained layers' weights."""
        return {f"{name}.weight": m.weight for name, m in layers.items()}

    def apply(self, model: nn.Module, tokenizer, requests: Sequence[EditRequest], ctx: EditContext) -> EditOutcome:
        """Edit ``model`` in place with ``requests``; default: the projected loop on :meth:`trainable`
        under :meth:`projectors` (Adam, optionally continued from ``ctx.optimizer_state``)."""
        from .loop import projected_finetune
        from .optim import load_optimizer_state, make_optimizer, optimizer_state, reproject_first_moment

        cfg, layers = ctx.config, ctx.layers
        projectors = self.projectors(layers, ctx.factors, cfg)
        params = self.trainable(layers)
        opt = make_optimizer(params, projectors, layers, cfg)
        carried = bool(ctx.optimizer_state)
        if carried:
            load_optimizer_state(opt, params, ctx.optimizer_state)
            if ctx.reproject_momentum:
                reproject_first_moment(opt, params, projectors, layers)
        budget = self.drift_budget(params, layers, ctx)
        history = projected_finetune(
            model,
            tokenizer,
            requests,
            layers,
            params,
            projectors,
            cfg,
            optimizer=opt,
            progress=ctx.progress,
            drift_budget=budget,
            checkpoint=ctx.checkpoint,
        )
        return EditOutcome(
            history,
            {n: p.stats() for n, p in projectors.items()},
            optimizer_state(opt, params) if ctx.keep_optimizer else {},
            carried,
            None if budget is None else budget.to_json(),
        )

    def drift_modules(self, model: nn.Module, layers: dict[str, nn.Module], config: EditConfig) -> dict[str, nn.Module]:
        """The linear modules (module name -> module) whose weight change the drift is predicted for: the
        capability K-FAC factors of these are what ``kl_predicted``, ``--max-drift`` and ``--drift-penalty``
        are measured with. Default: the edit layers (LoRA: the adapted modules)."""
        return layers

    def budget_factors(self, ctx: EditContext) -> KFACFactors | None:
        """The capability K-FAC factors ``--max-drift`` / ``--drift-penalty`` are measured with
        (``ctx.drift_factors``, else ``ctx.factors``: those :func:`~crispedit.editing.api.edit_factors` fetched for
        :meth:`drift_modules`, a curvature editor's own included), or ``None`` when ``ctx.config`` sets neither.
        One-line error when one is set and no factors were given."""
        if ctx.config.max_drift is None and not ctx.config.drift_penalty:
            return None
        factors = ctx.drift_factors if ctx.drift_factors is not None else ctx.factors
        if factors is None:
            raise CrispEditError(
                f"--max-drift / --drift-penalty need the capability K-FAC factors of the {self.name} "
                "edit's layers, and none were given"
            )
        return factors

    def drift_budget(self, params: dict[str, nn.Parameter], layers: dict[str, nn.Module], ctx: EditContext):
        """The ``--max-drift`` trust region and ``--drift-penalty`` over ``params`` (a :class:`DriftBudget` from
        the edit's start, with :meth:`budget_factors`), or ``None`` when ``ctx.config`` sets neither. Every
        fine-tuning editor takes it: one without curvature of its own (ft, locbf-ft) is measured with the
        capability factors fetched for it."""
        factors = self.budget_factors(ctx)
        if factors is None:
            return None
        from ..curvature.predicted import DriftBudget

        reference = None
        if ctx.drift_reference is not None:  # the trained weights are keyed by module name
            missing = [n for n in params if f"{n}.weight" not in ctx.drift_reference]
            if missing:
                raise CrispEditError(f"the drift penalty's reference weights do not hold {missing[0]}.weight")
            reference = {n: ctx.drift_reference[f"{n}.weight"] for n in params}
        return DriftBudget(
            params, layers, factors, ctx.config.max_drift, penalty=ctx.config.drift_penalty, reference=reference
        )
