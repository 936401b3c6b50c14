"""Keys and target values of the closed-form editors (MEMIT, AlphaEdit), written once.

A closed-form editor writes each fact as a key → value association into the MLP output projections
(``down_proj``) of the edit layers:

* the *key* of a request at edit layer ``l`` is the input of that layer (``d_in``, the MLP's hidden
  activation) at the **last token of the subject** in the prompt, averaged as MEMIT does: the mean of
  the key in the bare prompt and the mean key over a few prefix contexts (:func:`context_templates`);
* the *target value* ``v*`` (:func:`target_values`) is the output of the decoder block holding the
  **last** edit layer, at the same token, optimised so that the model produces the target: ``δ`` is added
  to that block's output at the subject token of every context, Adam minimises
  ``NLL(target) + kl_factor·KL(p_δ‖p_0) on "{subject} is a" + weight_decay·‖δ‖/‖h‖²`` and ``δ`` is clamped
  to ``clamp·‖h‖`` after each step (``h``: the unedited output at that token); ``v* = h + δ``;
* the *residual* of edit layer ``i`` of ``L`` is ``(v* − h_now) / (L − i)`` with ``h_now`` the block output
  on the current (partly updated) model (:func:`block_outputs`): each layer writes its share and the
  later layers the rest.

The subject's last token is found from the tokenizer's character offsets (a request needs its
``subject`` field and the subject must occur in the prompt; one-line :class:`CrispEditError`
otherwise). Statistics and solves are the callers'; this module only runs the model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..data.edits import EditRequest
from ..data.tokenize import collate, join_prompt_target, split_context_target
from ..errors import CrispEditError
from ..forward_args import takes_full_masks
from ..forward_parts import capture_block_input, forward_until, no_cache_kwargs, passthroughs, prefix_fed, rows_logits
from ..layers import decoder_blocks
from .fastpath import may_pack, pack_if_it_pays, target_rows
from .prefixtree import PackedBatch

__all__ = [
    "KeyValueSettings",
    "subject_span",
    "subject_token_index",
    "context_templates",
    "edit_blocks",
    "layer_keys",
    "block_outputs",
    "target_values",
    "hidden_size",
    "KL_TEMPLATE",
    "suffix_steps",
]

KL_TEMPLATE = "{} is a"  # MEMIT's essence prompt: the subject's distribution it keeps

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


@dataclass
class KeyValueSettings:
    """The ``v*`` optimisation: ``steps`` Adam steps at ``lr``, ``weight_decay`` on ``‖δ‖/‖h‖²``, ``clamp``
    (``‖δ‖ ≤ clamp·‖h‖``), ``kl_factor`` on the essence-prompt KL, early stop below ``stop_loss``; ``chunk``
    requests share each forward."""

    steps: int = 25
    lr: float = 0.5
    weight_decay: float = 1e-3
    clamp: float = 4.0
    kl_factor: float = 0.0625
    stop_loss: float = 5e-2
    chunk: int = 8  # requests optimised side by side (each with its own δ, loss and stop)


def subject_span(request: EditRequest, index: int | None = None) -> tuple[int, int]:
    """Character span ``[start, end)`` of the request's subject in its prompt (first exact occurrence,
    else first case-insensitive one); one-line error when the subject is missing or absent."""
    where = f"edit request {index}" if index is not None else "edit request"
    subject = (request.subject or "").strip()
    if not subject:
        raise CrispEditError(
            f"{where} ({request.prompt!r}) has no subject; closed-form editors (memit, alphaedit) "
            "need the `subject` field (ZsRE, CounterFact and WikiBigEdit records have it)"
        )
    start = request.prompt.find(subject)
    if start < 0:
        start = request.prompt.lower().find(subject.lower())
    if start < 0:
        raise CrispEditError(f"{where}: subject {subject!r} does not occur in its prompt {request.prompt!r}")
    return start, start + len(subject)


def subject_token_index(tokenizer, text: str, end_char: int) -> int:
    """Index of the token of ``tokenizer(text)`` holding the character ``end_char - 1`` (the subject's
    last token). Fast tokenizers: from the character offsets; others: the length of the tokenised
    ``text[:end_char]`` minus one."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, return_offsets_mapping=True)
        hits = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s and s < end_char]
        if hits:
            return hits[-1]
    return len(tokenizer(text[:end_char])["input_ids"]) - 1


def context_templates(model: nn.Module, tokenizer, n_prefixes: int, seed: int = 0) -> list[str]:
    """MEMIT's context templates: ``"{}"`` (the bare prompt) and ``n_prefixes`` short texts the model writes
    itself (:func:`~crispedit.editing.written.generated_prefixes`: ≤ 10 tokens after "The", "Therefore",
    "Because", "I", "You", drawn round-robin over the starts), each followed by ``" {}"``. Call it on the
    unedited model; a session's later rounds get the unedited model's through
    :func:`~crispedit.editing.written.prefixes_from`."""
    if n_prefixes <= 0:
        return ["{}"]
    from .written import GEN_STARTS, generated_prefixes

    per = -(-n_prefixes // len(GEN_STARTS))
    gen = generated_prefixes(model, tokenizer, per_start=per, seed=seed)
    order = [gen[s * per + i] for i in range(per) for s in range(len(GEN_STARTS))]
    return ["{}"] + [p.replace("{", " ").replace("}", " ") + " {}" for p in order[:n_prefixes]]


def edit_blocks(model: nn.Module, layers: dict[str, nn.Module]) -> tuple[list[int], nn.Module]:
    """The decoder-block index of every edit layer (in the given order, which must be increasing) and the
    block module holding the last one (where ``v*`` lives); one-line error for layers outside the blocks."""
    prefix, blocks = decoder_blocks(model)
    idx = []
    for name in layers:
        rest = name[len(prefix) + 1 :] if name.startswith(prefix + ".") else ""
        head = rest.split(".")[0]
        if not head.isdigit():
            raise CrispEditError(f"closed-form edit layer {name!r} is not inside the decoder blocks {prefix}")
        idx.append(int(head))
    if idx != sorted(set(idx)):
        raise CrispEditError(f"closed-form edit layers must be in distinct, increasing blocks, got {list(layers)}")
    return idx, blocks[idx[-1]]


def _positions(tokenizer, texts: Sequence[str], ends: Sequence[int], device) -> tuple[dict, Tensor]:
    """Right-padded encoding of ``texts`` and the subject-last-token index of each row."""
    pos = torch.tensor([subject_token_index(tokenizer, t, e) for t, e in zip(texts, ends)], device=device)
    side = getattr(tokenizer, "padding_side", "right")
    tokenizer.padding_side = "right"
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}, pos


def _filled(requests: Sequence[EditRequest], templates: Sequence[str]) -> tuple[list[str], list[int]]:
    """Every request's prompt in every template (request-major) and the subject's end character in each."""
    texts, ends = [], []
    for i, r in enumerate(requests):
        _, end = subject_span(r, i)
        for t in templates:
            pre = t.index("{}")
            texts.append(t.replace("{}", r.prompt, 1))
            ends.append(pre + end)
    return texts, ends


@torch.no_grad()
def layer_keys(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    layer: nn.Module,
    templates: Sequence[str],
    batch_size: int = 32,
) -> Tensor:
    """Keys of ``requests`` at ``layer``: its input (``d_in``) at the subject's last token, for each prompt
    in each template; per request the mean of the bare-prompt key (template 0) and the mean key over the
    other templates (MEMIT's weighting; the bare key alone without other templates). Returns ``N x d_in``
    float32."""
    texts, ends = _filled(requests, templates)
    device = next(model.parameters()).device
    rows: list[Tensor] = []
    for b in range(0, len(texts), batch_size):
        enc, pos = _positions(tokenizer, texts[b : b + batch_size], ends[b : b + batch_size], device)
        x = forward_until(model, layer, output=False, **enc)  # nothing above the layer runs
        rows.append(x[torch.arange(len(pos), device=device), pos].float())
    k = torch.cat(rows).view(len(requests), len(templates), -1)
    return k[:, 0] if len(templates) == 1 else 0.5 * (k[:, 0] + k[:, 1:].mean(1))


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, h):
    return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h


@torch.no_grad()
def block_outputs(
    model: nn.Module, tokenizer, requests: Sequence[EditRequest], block: nn.Module, batch_size: int = 32
) -> Tensor:
    """Output of ``block`` (the residual stream after it, ``d_model``) at the subject's last token of each
    bare prompt: ``N x d_model`` float32 (MEMIT's current ``z``)."""
    texts, ends = _filled(requests, ["{}"])
    device = next(model.parameters()).device
    rows = []
    for b in range(0, len(texts), batch_size):
        enc, pos = _positions(tokenizer, texts[b : b + batch_size], ends[b : b + batch_size], device)
        h = forward_until(model, block, output=True, **enc)  # nothing above the block runs
        rows.append(h[torch.arange(len(pos), device=device), pos].float())
    return torch.cat(rows)


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


class _DeltaForward:
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


def target_values(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    block: nn.Module,
    templates: Sequence[str],
    settings: KeyValueSettings,
    on_chunk: Callable[[int], None] | None = None,
) -> tuple[Tensor, dict]:
    """``v*`` of every request at ``block``'s output (module docstring): ``N x d_model`` float32, and a record
    (mean first / last NLL per target token, Adam steps summed over requests, mean ‖δ‖/‖h‖).

    Each request has its own ``δ``, loss, early stop and clamp, exactly as the authors optimise one
    request at a time; ``settings.chunk`` requests share each forward (Adam acts per element, and a
    request that has stopped keeps its ``δ``), so the result equals the one-at-a-time optimisation up
    to the padding's rounding. ``on_chunk(n)`` is called after each chunk with the number of its requests
    (progress reports)."""
    from ..curvature.statistics import frozen

    out, first, last, steps = [], [], [], 0
    verdicts: dict = {}  # each shortcut checked on the first chunk that can use it
    was_training = model.training
    model.eval()
    try:
        with frozen(model):
            for b in range(0, len(requests), settings.chunk):
                v, f, lst, st = _optimise_chunk(
                    model, tokenizer, requests[b : b + settings.chunk], b, block, templates, settings, verdicts
                )
                out.append(v)
                if on_chunk is not None:
                    on_chunk(len(f))
                first += f
                last += lst
                steps += st
    finally:
        model.train(was_training)
    n = max(len(requests), 1)
    V = torch.cat(out)
    return V, {"nll_first": sum(first) / n, "nll_last": sum(last) / n, "steps": steps}


def _optimise_chunk(model, tokenizer, requests, offset, block, templates, settings, verdicts):
    """:func:`target_values` for one chunk: ``(v* rows, first NLLs, last NLLs, Adam steps)``."""
    device = next(model.parameters()).device
    n, n_t = len(requests), len(templates)
    rows, pos, kl_rows, kl_pos = [], [], [], []
    for i, r in enumerate(requests):
        _, end = subject_span(r, offset + i)
        for t in templates:
            pre = t.index("{}")
            ctx = t.replace("{}", r.prompt, 1)
            rows.append(split_context_target(tokenizer, ctx, join_prompt_target(ctx, r.target)))
            pos.append(subject_token_index(tokenizer, ctx, pre + end))
        subj = (r.subject or "").strip()
        kl_text = KL_TEMPLATE.format(r.prompt[end - len(subj) : end])
        ids = list(tokenizer(kl_text)["input_ids"])
        kl_rows.append((ids, len(ids)))  # no target: its logits feed the KL term
        kl_pos.append(subject_token_index(tokenizer, kl_text, len(subj)))
    m = len(rows)
    # one batch, one forward a step: the n·n_t target rows, then the n KL rows (logits at their δ position only)
    batch = collate(tokenizer, rows + kl_rows, max_len=10**6).to(device)
    T = batch.input_ids.shape[1]
    pos_t = torch.tensor(pos + kl_pos, device=device)
    owner = torch.arange(n, device=device).repeat_interleave(n_t)  # request of each target row
    row_request = torch.cat([owner, torch.arange(n, device=device)])  # ... and of every row, KL rows last
    labels = batch.labels[:m, 1:]
    tmask = labels != -100
    n_tgt = tmask.sum(1).clamp_min(1)
    enc = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    t_rows = target_rows(batch.labels)[0]  # the order of [:m, :-1][tmask]
    kl_at = (m + torch.arange(n, device=device)) * T + pos_t[m:]
    fwd = _DeltaForward(model, block, enc, pos_t, torch.cat([t_rows, kl_at]), verdicts)
    n_r = len(t_rows)
    h0 = fwd.h[torch.arange(0, m, n_t, device=device), pos_t[:m:n_t]].float()
    delta = torch.zeros(n, h0.shape[1], device=device, dtype=torch.float32, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=settings.lr)
    kl0 = None
    active = torch.ones(n, dtype=torch.bool, device=device)
    first = None
    last_nll = torch.zeros(n, dtype=torch.float64)
    steps = 0
    for it in range(settings.steps):
        opt.zero_grad()
        logits = fwd(delta[row_request])
        lp = torch.log_softmax(logits[:n_r], -1)  # target positions only
        kl_logp = torch.log_softmax(logits[n_r:], -1)  # the subject's last token
        if kl0 is None:
            kl0 = kl_logp.detach()
        tok_lp = torch.zeros(labels.shape, device=device)
        tok_lp[tmask] = lp.gather(-1, labels[tmask].unsqueeze(-1)).squeeze(-1)
        row_nll = -tok_lp.sum(1) / n_tgt
        nll = torch.zeros(n, device=device).index_add(0, owner, row_nll) / n_t
        kl = settings.kl_factor * (kl_logp.exp() * (kl_logp - kl0)).sum(-1)  # KL(p_δ ‖ p_0), as the authors
        wd = settings.weight_decay * delta.norm(dim=1) / h0.norm(dim=1) ** 2
        loss = nll + kl + wd
        if first is None:
            first = nll.detach().double().cpu()
        stop = active & ((loss.detach() < settings.stop_loss) | (it == settings.steps - 1))
        last_nll[stop.cpu()] = nll.detach().double().cpu()[stop.cpu()]
        active = active & ~stop
        if not bool(active.any()):
            break
        (loss * active).sum().backward()
        kept = delta.detach()[~active].clone()
        opt.step()
        steps += int(active.sum())
        with torch.no_grad():
            delta[~active] = kept  # stopped requests keep their δ
            cap = settings.clamp * h0.norm(dim=1)
            norm = delta.norm(dim=1)
            over = norm > cap
            delta[over] *= (cap[over] / norm[over]).unsqueeze(1)
    return (h0 + delta).detach().float(), first.tolist(), last_nll.tolist(), steps


def hidden_size(model: nn.Module) -> int:
    """The model's residual-stream width (``hidden_size`` / ``n_embd`` / ``d_model`` of its text config)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    for key in ("hidden_size", "n_embd", "d_model"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise CrispEditError("cannot tell this model's hidden size (no hidden_size / n_embd in its config)")
