"""Exact shortcuts for the edit loss when the same batches are seen for many epochs.

Three savings, all exact (same numbers as a plain forward up to the order of the additions):

* **frozen prefix**: only the chosen layers train, so the hidden states entering the lowest decoder
  block that holds a trained parameter never change. They are computed once per batch; during
  training the blocks below are replaced by pass-throughs and the cached states are fed in.
* **target-only logits**: the FT-M loss needs logits only at target positions, so the output
  projection (a large share of a small model's forward) runs on those rows only.
* **shared prefixes**: positions that several sequences of a batch share (the chat template's header, a
  request's question under several lead-ins) are computed once, the batch packed as prefix trees
  (:mod:`.prefixtree`), where a cost model says it pays and the model takes full attention masks (PyTorch's
  scaled-dot-product attention, no sliding window) and has no dropout; :func:`prefix_sharing` turns it off.

Per-step work that does not depend on the weights is done once per batch: the flat indices of the target
rows and their labels, the attention mask (:func:`~crispedit.forward_args.static_attention_mask`: built once, so that no
step reads a
value back to the host) and the pass-through modules. Hugging Face models run without a KV cache
(``use_cache=False``; training never reads it, and filling it copies every block's keys and values).

Before use, the fast loss is compared with the plain :func:`edit_loss` on the batch with the most padding
(so a precomputed attention mask is checked too); if they
differ (an architecture that post-processes logits, or decoder blocks with side effects) the loop
silently falls back to the plain loss. The packed loss is compared the same way on the batch whose packing saves
the most, and packing is dropped if it differs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.tokenize import EncodedBatch
from ..forward_args import static_attention_mask, takes_full_masks
from ..forward_parts import (
    _up,
    capture_block_input,
    lowest_block,
    no_cache_kwargs,
    passthroughs,
    prefix_fed,
    rows_logits,
)
from ..layers import decoder_blocks
from .prefixtree import PackedBatch, pack_prefixes, packing_pays

__all__ = [
    "make_loss_fn",
    "LossFn",
    "Prepared",
    "plain_loss",
    "target_rows",
    "prefix_sharing",
    "may_pack",
    "pack_if_it_pays",
]

_SHARING = contextvars.ContextVar("crispedit_prefix_sharing", default=True)


@contextlib.contextmanager
def prefix_sharing(enabled: bool) -> Iterator[None]:
    """Within: fast losses made by :func:`make_loss_fn` pack shared prefixes (:mod:`.prefixtree`) only if
    ``enabled`` (default outside: on). For measuring the packing and for tests; results agree either way."""
    token = _SHARING.set(enabled)
    try:
        yield
    finally:
        _SHARING.reset(token)


def may_pack(model: nn.Module) -> bool:
    """Whether packing is on and can be exact for ``model``: full attention masks reach every layer, and no dropout
    (a shared position would draw one dropout mask for all the sequences it stands for)."""
    if not _SHARING.get() or not takes_full_masks(model):
        return False
    cfg = getattr(model, "config", None)
    rates = [
        v for k, v in (vars(cfg).items() if cfg is not None else ()) if "dropout" in k and isinstance(v, (int, float))
    ]
    return not any(v > 0 for v in rates) and not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def plain_loss(model: nn.Module, batch: EncodedBatch, per_token: bool = False) -> Tensor:
    """Mean cross-entropy over target tokens (FT-M), from a full forward (no KV cache): a 0-d float32
    (float64 for a float64 model) tensor, nats per target token; ``per_token``: each target token's
    cross-entropy instead, in row-major order (:func:`target_rows`'s)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **no_cache_kwargs(model)).logits[
        :, :-1
    ]
    labels = batch.labels[:, 1:]
    flat, gold = _up(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if per_token:
        keep = gold != -100
        return F.cross_entropy(flat[keep], gold[keep], reduction="none")
    return F.cross_entropy(flat, gold, ignore_index=-100)


def pack_if_it_pays(input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> PackedBatch | None:
    """A right-padded ``B x T`` batch (``labels`` -100 = no target) packed as prefix trees
    (:func:`~.prefixtree.pack_prefixes`, on the batch's device) where :func:`~.prefixtree.packing_pays` says so,
    else ``None``; whether a model allows packing is :func:`may_pack`."""
    p = pack_prefixes(input_ids.cpu(), attention_mask.cpu(), labels.cpu())
    return p.to(input_ids.device) if packing_pays(tuple(input_ids.shape), p) else None


def target_rows(labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows, targets)`` of a ``B x T`` label matrix (-100 = no target): the flat row-major indices into the
    ``B x T`` positions of every position that predicts a target token (position ``t`` predicts label
    ``t + 1``; the order of ``hidden[:, :-1][labels[:, 1:] != -100]``) and those target tokens."""
    shifted = labels[:, 1:]
    b, t = (shifted != -100).nonzero(as_tuple=True)
    return b * labels.shape[1] + t, shifted[b, t]


@dataclass
class Prepared:
    """A batch made for one epoch (``--context-sample``), made ready on the host before it goes to the device:
    ``batch`` (on the device), its target rows and tokens (:func:`target_rows`), its attention mask
    (:func:`~crispedit.forward_args.static_attention_mask`) and, for the fast loss, the flat rows of the cached
    prefix table every position reads (``B x T``; padding reads the zero row) — or, where the batch is packed as
    prefix trees (``packed``), of every packed position (``R·L``)."""

    batch: EncodedBatch
    rows: Tensor
    targets: Tensor
    mask: Tensor | None
    gather: Tensor | None = None
    packed: PackedBatch | None = None  # the batch as prefix trees; ``gather`` then indexes its packed positions


class _FastLoss:
    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        batches: Sequence[EncodedBatch],
        per_token: bool = False,
        mask_unpadded: bool = False,
        ordered: bool = True,
    ):
        self.model, self.batches = model, batches
        self.reduction = "none" if per_token else "mean"
        _, self.blocks = decoder_blocks(model)
        self.k = lowest_block(model, params.values()) or 0
        self.tuple_len: int | None = None
        self.cache: list[Tensor] = []
        # every cached prefix state in one table (``positions x d_model``, a zero row last), the batches' caches
        # views into it, and where each keyed sequence starts in it: a batch of other rows gathers its states
        self.table: Tensor | None = None
        self.start: dict[int, int] = {}
        if self.k > 0:
            # written in place batch by batch: the table is the part of an edit's memory that grows with the
            # edit set, and gathering the states first and concatenating them would hold it twice
            total, off = sum(b.input_ids.numel() for b in batches), 0
            with torch.no_grad():
                for b in batches:
                    h, self.tuple_len = capture_block_input(
                        model, self.blocks, self.k, input_ids=b.input_ids, attention_mask=b.attention_mask
                    )
                    (B, T), d = h.shape[:2], h.shape[-1]
                    if self.table is None:
                        self.table = h.new_empty(total + 1, d)
                        self.table[total].zero_()
                    view = self.table[off : off + B * T].view(B, T, d)
                    view.copy_(h)
                    self.cache.append(view)
                    for r, key in enumerate(b.keys or []):
                        self.start[key] = off + r * T
                    off += B * T
        self.passthrough = passthroughs(self.k, self.tuple_len)
        self.targets = [target_rows(b.labels) for b in batches]
        self.masks = [static_attention_mask(model, b.attention_mask, unpadded_mask=mask_unpadded) for b in batches]
        # packed targets are in tree order, not row-major: per-token losses are packed only where order is free
        self.pack = may_pack(model) and not (per_token and ordered)
        self.packed = [self.packing(b) for b in batches]

    def packing(self, batch: EncodedBatch) -> PackedBatch | None:
        """``batch`` packed as prefix trees (on its device) where packing is allowed and pays, else ``None``."""
        return pack_if_it_pays(batch.input_ids, batch.attention_mask, batch.labels) if self.pack else None

    def positions(self) -> int:
        """Positions one pass over the batches computes: ``R·L`` of a packed batch, ``B·T`` of the others."""
        return sum(
            p.input_ids.numel() if p is not None else b.input_ids.numel() for b, p in zip(self.batches, self.packed)
        )

    def __call__(self, index: int, batch: EncodedBatch) -> Tensor:
        """The FT-M loss of ``batch`` (``self.batches[index]``, whose prefix states are cached): 0-d, float32
        or better, nats per target token; from its prefix trees where it is packed."""
        if batch is self.batches[index] and self.packed[index] is not None:
            states = self.cache[index].reshape(-1, self.cache[index].shape[-1]) if self.k else None
            return self.packed_loss(self.packed[index], states, None)
        return self.padded(index, batch)

    def padded(self, index: int, batch: EncodedBatch) -> Tensor:
        """As :meth:`__call__`, always from the padded batch (its precomputed attention mask where it is the
        cached batch)."""
        own = batch is self.batches[index]
        rows, targets = self.targets[index] if own else target_rows(batch.labels)
        mask = self.masks[index] if own else batch.attention_mask
        return self._loss(batch, rows, targets, mask, self.cache[index] if self.k else None)

    def packed_loss(self, p: PackedBatch, states: Tensor | None, gather: Tensor | None) -> Tensor:
        """The FT-M loss of a batch packed as prefix trees: every packed position fed the cached prefix state of a
        position it stands for (``states`` row ``p.source``, or ``states`` row ``gather`` when given; ``states``
        ``None`` without a cached prefix)."""
        hidden = None
        if states is not None:
            hidden = states.index_select(0, p.source if gather is None else gather).view(*p.shape, -1)
        with prefix_fed(self.blocks, self.k, self.passthrough, hidden):
            logits = rows_logits(
                self.model, p.rows, input_ids=p.input_ids, attention_mask=p.mask, position_ids=p.position_ids
            )
        return F.cross_entropy(logits, p.targets, reduction=self.reduction)

    def _loss(self, batch: EncodedBatch, rows: Tensor, targets: Tensor, mask, hidden: Tensor | None) -> Tensor:
        with prefix_fed(self.blocks, self.k, self.passthrough, hidden):
            logits = rows_logits(self.model, rows, input_ids=batch.input_ids, attention_mask=mask)
        return F.cross_entropy(logits, targets, reduction=self.reduction)

    def gather_index(self, batch: EncodedBatch) -> Tensor | None:
        """For a batch (on the host) of keyed sequences that the cache holds: the table row of every position
        (``B x T`` long; padding and positions past a sequence's cached length read the zero row). ``None``
        without a cached prefix."""
        if self.table is None:
            return None
        B, T = batch.input_ids.shape
        lengths = batch.attention_mask.sum(1)
        zero = self.table.shape[0] - 1
        t = torch.arange(T)
        starts = torch.tensor([self.start[k] for k in batch.keys])
        return torch.where(t[None, :] < lengths[:, None], starts[:, None] + t[None, :], torch.full((), zero))

    def prepared(self, p: Prepared) -> Tensor:
        """The FT-M loss of an epoch's batch (:class:`Prepared`): its prefix states gathered from the table."""
        if p.packed is not None:
            return self.packed_loss(p.packed, self.table, p.gather)
        hidden = None
        if self.table is not None:
            B, T = p.batch.input_ids.shape
            hidden = self.table.index_select(0, p.gather.reshape(-1)).view(B, T, -1)
        return self._loss(p.batch, p.rows, p.targets, p.mask, hidden)


class LossFn:
    """The edit loop's loss: ``loss_fn(i)`` is the FT-M loss (0-d, nats per target token) of the ``i``-th of the
    batches it was made for; ``loss_fn(prepared)`` that of a batch made for one epoch (:meth:`prepare`).
    ``fast``: whether the verified shortcut (cached frozen prefix, head on target rows) computes it.
    ``per_token``: each target token's cross-entropy (row-major) instead of their mean."""

    def __init__(
        self, model: nn.Module, batches: Sequence[EncodedBatch], fast_loss: _FastLoss | None, per_token: bool = False
    ):
        self.model, self.batches, self._fast, self.per_token = model, batches, fast_loss, per_token
        self.fast = fast_loss is not None
        self.device = next(model.parameters()).device

    def layout(self) -> dict:
        """What one pass over the batches computes: ``positions_per_epoch`` (the fast loss's packed and padded
        positions, or the padded tokens of the plain loss), ``padded_per_epoch`` (``B·T`` summed) and
        ``packed_batches`` (batches packed as prefix trees)."""
        padded = sum(b.input_ids.numel() for b in self.batches)
        fast = self._fast
        return {
            "positions_per_epoch": padded if fast is None else fast.positions(),
            "padded_per_epoch": padded,
            "packed_batches": 0 if fast is None else sum(p is not None for p in fast.packed),
        }

    def prepare(self, batch: EncodedBatch) -> Prepared:
        """Ready a host batch of keyed sequences for the device, everything read from it computed on the host."""
        rows, targets = target_rows(batch.labels)
        mask = static_attention_mask(self.model, batch.attention_mask)
        gather = self._fast.gather_index(batch) if self._fast is not None else None
        packed = self._fast.packing(batch) if self._fast is not None else None
        if packed is not None and gather is not None:  # the table row of every packed position
            gather = gather.reshape(-1).index_select(0, packed.source)
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        return Prepared(
            batch.to(self.device),
            to(rows),
            to(targets),
            to(mask),
            to(gather),
            None if packed is None else packed.to(self.device),
        )

    def __call__(self, item) -> Tensor:
        if isinstance(item, Prepared):
            return (
                self._fast.prepared(item)
                if self._fast is not None
                else plain_loss(self.model, item.batch, self.per_token)
            )
        if self._fast is not None:
            return self._fast(item, self.batches[item])
        return plain_loss(self.model, self.batches[item], self.per_token)


def make_loss_fn(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    batches: Sequence[EncodedBatch],
    enabled: bool = True,
    per_token: bool = False,
    mask_unpadded: bool = False,
    ordered: bool = True,
) -> LossFn:
    """The edit loop's :class:`LossFn` over ``batches``: the verified fast loss, or the plain one (``per_token``:
    each target token's loss — row-major and unpacked while ``ordered``; without it the same terms in an order
    fixed per batch, packed where that pays; ``mask_unpadded``: a batch without padding gets the plain causal mask
    too, :func:`~crispedit.forward_args.static_attention_mask`, so its forward reads nothing back to the host)."""
    if not enabled or not batches:
        return LossFn(model, batches, None, per_token)
    # the check catches structural mismatches (a skipped logit transform gives a different loss), not
    # rounding: half-precision kernels may tile the smaller head matmul differently
    half = next(iter(params.values())).dtype in (torch.float16, torch.bfloat16) if params else False
    rtol = 1e-2 if half else 1e-4
    # compared in eval mode: dropout (e.g. a LoRA adapter's) would make two training-mode forwards differ
    was_training = model.training
    try:
        fast_loss = _FastLoss(model, params, batches, per_token, mask_unpadded, ordered)
        model.eval()
        # checked on the batch with the most padding, so a precomputed attention mask is checked too
        i = max(range(len(batches)), key=lambda j: int((batches[j].attention_mask == 0).sum()))
        with torch.no_grad():
            a, b = plain_loss(model, batches[i], per_token), fast_loss.padded(i, batches[i])
        if not torch.allclose(a, b, rtol=rtol, atol=1e-5):
            return LossFn(model, batches, None, per_token)
        packed = [j for j, p in enumerate(fast_loss.packed) if p is not None]
        if packed:  # checked on the batch whose packing saves the most positions
            j = max(packed, key=lambda j: batches[j].input_ids.numel() - fast_loss.packed[j].input_ids.numel())
            with torch.no_grad():
                a, b = plain_loss(model, batches[j], per_token), fast_loss(j, batches[j])
            if per_token:  # the same terms in tree order
                a, b = a.sort().values, b.sort().values
            if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=1e-5):
                fast_loss.pack, fast_loss.packed = False, [None] * len(batches)
    except Exception:  # any architecture the shortcut does not understand: use the plain loss
        return LossFn(model, batches, None, per_token)
    finally:
        model.train(was_training)
    return LossFn(model, batches, fast_loss, per_token)
