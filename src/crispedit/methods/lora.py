"""LoRA through peft: a low-rank adapter ``ΔW = (alpha/r)·B·A`` on the attention query and value
projections of the edit layers' decoder blocks, trained by the shared projected loop (identity
projector: plain Adam on ``A`` and ``B``; FT-M loss on the target tokens; the paper's lr 5e-3, early
stop 0.01) and merged into the base weights with peft's ``merge_and_unload`` — the edited model has
no adapter modules left; only ``q_proj``/``v_proj`` weights of those blocks change. ``--max-drift`` and
``--drift-penalty`` act on that merged update ``(alpha/r)·B·A``, measured with the capability K-FAC factors of
the adapted modules (where attention mixes positions, which the prediction under-reads).

Its options and the paper's defaults (r 8, alpha 32, dropout 0.1, lr 5e-3) are :class:`LoRAConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checks import check_float, check_int
from ..editing.editor import EditContext, Editor, EditOutcome, identity_projectors
from ..editing.registry import MethodConfig, MethodSpec
from ..errors import CrispEditError
from ..settings import setting

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LoRAConfig", "LoRAEditor", "ADAPTER", "METHOD"]


@dataclass
class LoRAConfig(MethodConfig):
    """Rank ``r`` (≥ 1), scale ``alpha`` (ΔW = alpha/r · B A), adapter ``dropout`` in [0, 1), and the
    comma-separated module names ``targets`` adapted in each edit layer's block. Paper defaults
    (EasyEdit's LoRA config for Llama-3-8B): r 8, alpha 32, dropout 0.1; lr 5e-3."""

    r: int = setting(8, help="adapter rank (default 8)")
    alpha: float = setting(32.0, help="adapter scale: delta W = alpha/r * B A (default 32)")
    dropout: float = setting(0.1, help="adapter dropout while training (default 0.1)")
    targets: str = setting(
        "q_proj,v_proj", help="comma-separated module names adapted in each edit layer's block (default q_proj,v_proj)"
    )
    SHARED = {"lr": 5e-3}

    def validate(self) -> LoRAConfig:
        """r a positive integer, alpha positive, dropout in [0, 1), targets non-empty."""
        self.r = check_int("lora rank r", self.r, 1)
        self.alpha = check_float("lora alpha", self.alpha, 0.0, lo_open=True)
        self.dropout = check_float("lora dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if not [t for t in str(self.targets).split(",") if t.strip()]:
            raise CrispEditError("lora targets is empty; give module names such as q_proj,v_proj")
        return self

    @property
    def scale(self) -> float:
        """``alpha / r``: the factor of ``B A`` in the merged weight."""
        return self.alpha / self.r


METHOD = MethodSpec(
    "lora",
    "low-rank adapter (peft) on q_proj/v_proj of the edit layers' blocks, merged after training",
    LoRAConfig,
    f"{__name__}:LoRAEditor",
    sequential="paper",
    drift_budget=True,
)

ADAPTER = "crispedit"  # the peft adapter name used while an edit trains


class LoRAEditor(Editor):
    """LoRA (peft) on the ``targets`` of the edit layers' blocks, merged after training."""

    name = "lora"
    carries_optimizer = False  # each edit (session round) trains a fresh adapter

    def target_modules(self, model: nn.Module, layers: dict[str, nn.Module], cfg: LoRAConfig) -> dict[str, nn.Module]:
        """Full name -> linear module of every ``cfg.targets`` module in the blocks holding the edit layers."""
        from torch import nn

        from ..layers import decoder_blocks

        prefix, blocks = decoder_blocks(model)
        indices = sorted({int(n[len(prefix) + 1 :].split(".")[0]) for n in layers if n.startswith(prefix + ".")})
        if not indices:
            raise CrispEditError(f"lora: the edit layers {list(layers)} are not inside the decoder blocks {prefix}")
        out = {}
        for i in indices:
            for t in (t.strip() for t in cfg.targets.split(",") if t.strip()):
                found = [
                    (f"{prefix}.{i}.{n}", m)
                    for n, m in blocks[i].named_modules()
                    if n.split(".")[-1] == t and isinstance(m, nn.Linear)
                ]
                if len(found) != 1:
                    raise CrispEditError(
                        f"lora: block {prefix}.{i} has {len(found)} linear modules named {t!r} "
                        "(set --lora-targets to this architecture's names)"
                    )
                out.update(found)
        return out

    def changes(self, model, layers, config):
        """The merged adapters change the weights of the target modules (``...q_proj.weight``, ``...v_proj.weight``)."""
        return {f"{n}.weight": m.weight for n, m in self.target_modules(model, layers, config.method_config).items()}

    def drift_modules(self, model, layers, config):
        """The target modules: the merged update changes their weights, so their capability K-FAC factors are
        what ``--max-drift`` / ``--drift-penalty`` measure it with."""
        return self.target_modules(model, layers, config.method_config)

    def drift_budget(self, params, layers, ctx: EditContext):
        """The ``--max-drift`` / ``--drift-penalty`` budget on the merged update ``(alpha/r) · B A`` of every
        adapted module (:class:`~crispedit.curvature.predicted.LowRankDriftBudget`); ``layers``: target name ->
        its peft LoRA layer (``lora_A``, ``lora_B``, ``scaling``, the base linear). ``None`` without either."""
        factors = self.budget_factors(ctx)
        if factors is None:
            return None
        if ctx.drift_reference is not None:
            raise CrispEditError("LoRA's drift penalty reads its fresh adapter's update; it takes no reference weights")
        from ..curvature.predicted import LowRankDriftBudget

        adapters = {
            n: (m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight, m.scaling[ADAPTER]) for n, m in layers.items()
        }
        return LowRankDriftBudget(
            adapters,
            {n: m.get_base_layer() for n, m in layers.items()},
            factors,
            ctx.config.max_drift,
            penalty=ctx.config.drift_penalty,
        )

    def apply(self, model, tokenizer, requests, ctx: EditContext) -> EditOutcome:
        """Inject a fresh adapter, train its ``A``/``B`` with the projected loop (identity projectors),
        merge it with ``merge_and_unload`` (also on failure, so no adapter is ever left behind). The adapter's
        initialisation and its dropout draw from generators seeded with ``config.seed`` (forked: the caller's
        are left as they were), so an edit is the same every time and a ``checkpoint`` resumes it exactly."""
        try:
            from peft import LoraConfig, LoraModel
        except ImportError:
            raise CrispEditError("the lora method needs peft: pip install peft") from None
        import torch

        from ..editing.loop import projected_finetune

        cfg: LoRAConfig = ctx.config.method_config
        targets = self.target_modules(model, ctx.layers, cfg)
        flags = {p: p.requires_grad for p in model.parameters()}  # peft freezes the base model
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(ctx.config.seed)
            tuner = LoraModel(
                model,
                LoraConfig(
                    r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none", target_modules=list(targets)
                ),
                ADAPTER,
            )
            try:
                modules = dict(model.named_modules())
                params = {
                    n: p
                    for n, p in model.named_parameters()
                    if f".lora_A.{ADAPTER}." in n or f".lora_B.{ADAPTER}." in n
                }
                owners = {n: modules[n.rpartition(".")[0]] for n in params}  # the adapter's own nn.Linear A / B
                projectors = identity_projectors(owners)
                budget = self.drift_budget(params, {n: modules[n] for n in targets}, ctx)
                history = projected_finetune(
                    model,
                    tokenizer,
                    requests,
                    owners,
                    params,
                    projectors,
                    ctx.config,
                    progress=ctx.progress,
                    drift_budget=budget,
                    checkpoint=ctx.checkpoint,
                )
            finally:
                tuner.merge_and_unload()
                for p, f in flags.items():
                    p.requires_grad_(f)
        return EditOutcome(
            history,
            {n: {"kept_fraction": 1.0} for n in targets},
            drift_budget=None if budget is None else budget.to_json(),
        )
