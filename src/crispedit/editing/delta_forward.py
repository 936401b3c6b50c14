"""The forward of the closed-form editors' target-value steps: logits of a frozen model with a vector ``δ`` added
to one decoder block's output at one position per row (:class:`DeltaForward`), computed as cheaply as exactness
allows — the blocks below once, the rows' shared beginnings once, the positions before ``δ`` once — each
shortcut checked against the plain forward before it is used. :mod:`.keyvalue` optimises ``δ`` through it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..errors import CrispEditError
from ..forward_args import takes_full_masks
from ..forward_parts import capture_block_input, no_cache_kwargs, passthroughs, prefix_fed, rows_logits
from ..layers import decoder_blocks
from .fastpath import may_pack, pack_if_it_pays
from .prefixtree import PackedBatch

__all__ = ["DeltaForward", "suffix_steps", "hidden_size"]

_SUFFIX = contextvars.ContextVar("crispedit_vstar_suffix", default=True)


@contextlib.contextmanager
def suffix_steps(enabled: bool) -> Iterator[None]:
    """Within: the ``v*`` steps run only the positions from each row's ``δ`` on (over the earlier positions'
    cached keys and values) if ``enabled`` (default outside: on). For measuring it and for tests; the ``v*``
    agree either way up to float rounding."""
    token = _SUFFIX.set(enabled)
    try:
        yield
    finally:
        _SUFFIX.reset(token)


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, h):
    return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h


@contextlib.contextmanager
def _add_at(block: nn.Module, pos: Tensor, delta: Tensor) -> Iterator[list]:
    """Add ``delta`` (``d_model``) to ``block``'s output at row ``i``, position ``pos[i]``; yields the list
    that receives the unmodified output of each forward."""
    seen: list[Tensor] = []

    def hook(mod, args, output):
        """Forward hook: record the output hidden states (detached), return them with ``delta`` added at ``pos``."""
        h = _hidden(output)
        seen.append(h.detach())
        h = h.clone()
        h[torch.arange(len(pos), device=h.device), pos] += delta.to(h.dtype)
        return _replace_hidden(output, h)

    handle = block.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _suffix_layout(starts: Sequence[int], ends: Sequence[int], T: int) -> dict[str, list[list[int]]]:
    """Rows ``b`` of a ``B x T`` batch cut at ``starts[b]``: the suffixes ``[starts[b], ends[b])`` packed first-fit,
    longest first, into rows of the longest suffix's length, and each packed row's past — its suffixes' positions
    ``[0, starts[b])`` side by side, left-padded to the longest. ``{"new": R x Q, "past": R x P}`` flat indices
    ``b·T + t`` into the batch, ``-1`` for padding."""
    order = sorted(range(len(starts)), key=lambda b: (starts[b] - ends[b], b))
    Q = max(e - s for s, e in zip(starts, ends))
    bins: list[list[int]] = []
    room: list[int] = []
    for b in order:
        n = ends[b] - starts[b]
        i = next((i for i, r in enumerate(room) if r >= n), None)
        if i is None:
            bins.append([])
            room.append(Q)
            i = len(bins) - 1
        bins[i].append(b)
        room[i] -= n
    new = [[b * T + t for b in row for t in range(starts[b], ends[b])] for row in bins]
    past = [[b * T + t for b in row for t in range(starts[b])] for row in bins]
    P = max(1, max(len(p) for p in past))
    return {"new": [r + [-1] * (Q - len(r)) for r in new], "past": [[-1] * (P - len(p)) + p for p in past]}


class DeltaForward:
    """Logits at chosen positions of ``model(**enc)`` with ``δ`` added to ``block``'s output at given
    positions, for the ``v*`` steps. Exact shortcuts, as the edit loop's (:mod:`.fastpath`): the model is
    frozen and ``δ`` enters at ``block``'s output, so everything up to it is computed once and each step
    runs only the blocks above it, with the output head on the needed rows only; and where the rows share
    beginnings (the context templates' prefixes, across the requests of a chunk) and the cost model says it
    pays, the blocks above run on the batch packed as prefix trees (:mod:`.prefixtree`), each shared position
    once — used only where every ``δ`` position is a node of its own row alone, so no ``δ`` reaches another
    row. Better still where the model takes full attention masks and keeps a key/value cache: a row's positions
    before its ``δ`` position never see ``δ`` (causal attention), so their keys and values in the blocks above
    are computed once, and each step runs only every row's *suffix* — from its ``δ`` position to its last logit
    row — over those cached keys and values (``self.suffix``; used when every logit row lies in its row's suffix;
    :func:`suffix_steps` turns it off). Each shortcut is checked (the cached one against the plain forward, hook
    on ``block`` and full logits, at ``δ = 0``; the suffix and packed ones against the cached one at a random
    ``δ``); where one differs, or ``block`` is the last block or not a decoder block, the plainer forward is used.
    ``verdicts``: a dict shared by the forwards of one optimisation (one model, block and kind of batch) that
    keeps each check's outcome, so that only the first forward that can use a shortcut pays for its check — as
    the edit loop checks its fast loss on one batch. ``self.h`` holds ``block``'s unedited output
    (``B x T x d_model``)."""

    def __init__(
        self, model: nn.Module, block: nn.Module, enc: dict, pos: Tensor, rows: Tensor, verdicts: dict | None = None
    ):
        self.model, self.block, self.enc, self.pos, self.rows = model, block, enc, pos, rows
        self.arange = torch.arange(len(pos), device=pos.device)
        _, blocks = decoder_blocks(model)
        self.blocks, self.k = blocks, next((i + 1 for i, b in enumerate(blocks) if b is block), 0)
        v = {} if verdicts is None else verdicts
        self.fast = 0 < self.k < len(blocks) and v.get("fast") is not False
        self.packed: PackedBatch | None = None
        self.suffix: dict | None = None
        with torch.no_grad():
            zero = torch.zeros(len(pos), hidden_size(model), device=pos.device)
            if self.fast:
                self.h, tuple_len = capture_block_input(model, blocks, self.k, **enc)
                self.passthrough = passthroughs(self.k, tuple_len)
                if "fast" not in v:
                    v["fast"] = bool(torch.allclose(self._fast(zero), self._plain(zero)[0], rtol=1e-4, atol=1e-4))
                self.fast = v["fast"]
            if not self.fast:
                self.h = self._plain(zero)[1]
                return
            if _SUFFIX.get() and takes_full_masks(model) and v.get("suffix") is not False:
                ok = self._try_suffix(check="suffix" not in v)
                if ok is not None:
                    v["suffix"] = ok
            if self.suffix is None and may_pack(model) and v.get("packed") is not False:
                ok = self._try_packing(check="packed" not in v)
                if ok is not None:
                    v["packed"] = ok

    def _agrees_with_cached(self, forward: Callable[[Tensor], Tensor]) -> bool:
        """Whether ``forward`` gives the cached forward's logits at a fixed random ``δ`` (a tenth of each row's
        ``‖h‖`` per unit); a forward that raises does not agree."""
        gen = torch.Generator().manual_seed(0)
        probe = (torch.randn(len(self.pos), self.h.shape[-1], generator=gen) * 0.1).to(self.h.device, torch.float32)
        probe = probe * self.h[self.arange, self.pos].float().norm(dim=1, keepdim=True)
        try:
            return bool(torch.allclose(forward(probe), self._fast(probe), rtol=1e-4, atol=1e-4))
        except Exception:
            return False

    def _try_suffix(self, check: bool) -> bool | None:
        """Set ``self.suffix`` where every logit row lies at or after its row's ``δ`` position and the model fills a
        :class:`~transformers.DynamicCache`; with ``check``, only if the suffix forward gives the cached forward's
        logits at a random ``δ``. Returns the check's outcome (``True`` unchecked, ``False`` for a model without
        the cache), ``None`` where the rows do not allow it. A row's *suffix* runs from its ``δ`` position to its
        last logit row (the tokens after it reach no needed logit); the suffixes are packed first-fit, longest
        first, into rows as long as the longest, each packed row attending to its own suffixes' cached pasts
        (left-padded, side by side) and, causally, to its own suffix (:func:`_suffix_layout`)."""
        ids, am = self.enc["input_ids"], self.enc["attention_mask"]
        T, dev = ids.shape[1], ids.device
        lens, s = am.sum(1), self.pos
        rb, rt = self.rows // T, self.rows % T
        if bool((rt < s[rb]).any()) or bool((rt >= lens[rb]).any()) or bool((s >= lens).any()):
            return None
        P = max(1, int(s.max()))  # the pasts lie before every row's δ
        try:
            from transformers import DynamicCache

            cache = DynamicCache()
            with prefix_fed(self.blocks, self.k, self.passthrough, self.h[:, :P]):
                self.model.get_decoder()(
                    input_ids=ids[:, :P], attention_mask=am[:, :P], past_key_values=cache, use_cache=True
                )
            full = [(layer.keys, layer.values) if i >= self.k else None for i, layer in enumerate(cache.layers)]
        except Exception:  # a model without Hugging Face's cache API: the cached forward serves
            return False
        end = (s + 1).scatter_reduce(0, rb, rt + 1, "amax")  # one past each row's last logit row
        lay = _suffix_layout(s.tolist(), end.tolist(), T)
        new_src, past_src = (torch.tensor(x, device=dev) for x in (lay["new"], lay["past"]))
        new_ok, past_ok = new_src >= 0, past_src >= 0
        new_src, past_src = new_src.clamp_min(0), past_src.clamp_min(0)
        new_b, past_b = new_src // T, past_src // T
        R, Q = new_src.shape

        past_at = past_b * P + past_src % T  # into the B x P positions run above

        def past(x: Tensor) -> Tensor:
            """A block's ``B x heads x P x d_head`` keys or values at the packed rows' past slots."""
            flat = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # (B·P) x heads x d_head
            return flat[past_at].transpose(1, 2)

        same = new_b[:, :, None] == new_b[:, None, :]
        causal = new_src[:, None, :] <= new_src[:, :, None]
        eye = torch.eye(Q, dtype=torch.bool, device=dev)[None]  # padding attends to itself: no NaN
        new_cols = (same & causal & new_ok[:, None, :] & new_ok[:, :, None]) | eye
        past_cols = (past_b[:, None, :] == new_b[:, :, None]) & past_ok[:, None, :] & new_ok[:, :, None]
        slot = torch.full((len(s) * T,), -1, dtype=torch.long, device=dev)
        slot[new_src[new_ok]] = torch.arange(R * Q, device=dev).view(R, Q)[new_ok]
        self.suffix = {
            "cache": DynamicCache,
            "kv": [None if e is None else (past(e[0]), past(e[1])) for e in full],
            "inputs": {
                "input_ids": ids.view(-1)[new_src],
                "position_ids": new_src % T,
                "attention_mask": torch.cat([past_cols, new_cols], 2)[:, None],
            },
            "h": self.h.reshape(-1, self.h.shape[-1])[new_src],
            "delta_at": slot[torch.arange(len(s), device=dev) * T + s],
            "rows": slot[self.rows],
        }
        if check and not self._agrees_with_cached(self._suffix):
            self.suffix = None
            return False
        return True

    def _try_packing(self, check: bool) -> bool | None:
        """Set ``self.packed`` (and its cached states, ``δ`` positions and logit rows) where packing pays and keeps
        every ``δ`` position to its own row; with ``check``, only if it gives the cached forward's logits at a
        random ``δ``. Returns the check's outcome (``True`` unchecked), ``None`` where the rows do not allow it."""
        ids = self.enc["input_ids"]
        p = pack_if_it_pays(ids, self.enc["attention_mask"], torch.full_like(ids, -100))
        if p is None:
            return None
        where = p.where
        node = where[self.arange, self.pos]
        rows_through = torch.bincount(where[where >= 0], minlength=p.input_ids.numel())
        if bool((node < 0).any()) or bool((rows_through[node.clamp_min(0)] != 1).any()):
            return None  # a δ position is padding or shared with another row: δ would reach that row too
        d = self.h.shape[-1]
        self.packed, self.node, self.prow = p, node, where.view(-1)[self.rows]
        self.hp = self.h.reshape(-1, d).index_select(0, p.source)
        if check and not self._agrees_with_cached(self._packed):
            self.packed = None
            return False
        return True

    def _plain(self, delta: Tensor) -> tuple[Tensor, Tensor]:
        """Logits at ``rows`` from the full forward with ``delta`` added by a hook, and ``block``'s output
        before the addition."""
        with _add_at(self.block, self.pos, delta) as seen:
            logits = self.model(**self.enc, **no_cache_kwargs(self.model)).logits
        return logits.reshape(-1, logits.shape[-1]).index_select(0, self.rows).float(), seen[0]

    def _fast(self, delta: Tensor) -> Tensor:
        h = self.h.clone()
        h[self.arange, self.pos] += delta.to(h.dtype)
        with prefix_fed(self.blocks, self.k, self.passthrough, h):
            return rows_logits(self.model, self.rows, **self.enc).float()

    def _suffix(self, delta: Tensor) -> Tensor:
        sx = self.suffix
        h = sx["h"].clone()
        h.view(-1, h.shape[-1])[sx["delta_at"]] += delta.to(h.dtype)
        cache = sx["cache"](ddp_cache_data=[(None, None) if e is None else e for e in sx["kv"]])
        with prefix_fed(self.blocks, self.k, self.passthrough, h):
            return rows_logits(self.model, sx["rows"], past_key_values=cache, use_cache=True, **sx["inputs"]).float()

    def _packed(self, delta: Tensor) -> Tensor:
        p = self.packed
        h = self.hp.clone()
        h[self.node] += delta.to(h.dtype)
        with prefix_fed(self.blocks, self.k, self.passthrough, h.view(*p.shape, -1)):
            return rows_logits(
                self.model, self.prow, input_ids=p.input_ids, attention_mask=p.mask, position_ids=p.position_ids
            ).float()

    def __call__(self, delta: Tensor) -> Tensor:
        """``R x vocab`` float32 logits at ``rows`` with ``delta`` (``len(pos) x d_model``, one per row of
        ``enc``) added at each row's position; differentiable in ``delta``."""
        if self.suffix is not None:
            return self._suffix(delta)
        if self.packed is not None:
            return self._packed(delta)
        return self._fast(delta) if self.fast else self._plain(delta)[0]


def hidden_size(model: nn.Module) -> int:
    """The model's residual-stream width (``hidden_size`` / ``n_embd`` / ``d_model`` of its text config)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for key in ("hidden_size", "n_embd", "d_model"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise CrispEditError("cannot tell this model's hidden size (no hidden_size / n_embd in its config)")
