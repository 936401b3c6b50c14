"""Capability drift on held-out text: per-token KL(base || edited) and perplexity.

The base model is either a second model or, cheaper, the edited model with its original weights
swapped back in for each batch (only the trained layers differ, so this needs no second copy).
KL is averaged over every position that predicts a real next token (attention mask, never token ids).

With swapped weights the base's side is computed once per base, text set and batching and kept in this process
(:class:`BaseStates`): the base model's last hidden states at the counted positions and the hidden states entering
the lowest decoder block the edit changes, which the edit leaves as they were. A later measure of the same base —
the next round of a session, the next edit of the same model — then runs only the edited model's blocks from there
on, and the output head twice. Exact up to the order of additions; checked against the plain measure on the first
batch, which it falls back to when they differ. The kept side is also stored in the cache root
(``<cache>/drift/<base fingerprint>-<digest>.safetensors``, :func:`base_states_path`), so another process measuring
the same base — the next ``crispedit session add``, a restarted playground — reads it instead of running the base
again; a stored batch is used only where its token ids and mask are the ones being measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..curvature.lm_batches import loss_positions
from ..distributed import is_sharded
from ..errors import CrispEditError, WriteError
from ..forward_parts import (
    capture_block_input,
    decoder_rows,
    head_logits,
    lowest_block,
    passthroughs,
    prefix_fed,
    rows_logits,
)
from ..layers import decoder_blocks
from ..versions import check_written_by, stamped
from ..weights import parameter, weight_fingerprint

__all__ = ["kl_drift", "answer_kl", "swapped_weights", "perplexity", "BaseStates", "base_states_path"]

DRIFT_FORMAT = 1
_META_KEY = "crispedit_drift_base"


@contextlib.contextmanager
def swapped_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily put ``weights`` (full parameter name, or module name for its ``weight`` -> tensor)
    into ``model``; the current values come back on exit."""
    targets = {name: parameter(model, name) for name in weights}
    saved = {}
    with torch.no_grad():
        for name, w in weights.items():
            saved[name] = targets[name].detach().clone()
            targets[name].copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, w in saved.items():
                targets[name].copy_(w)


def _encode(tokenizer, texts, max_len, device):
    side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True, max_length=max_len)
    finally:
        tokenizer.padding_side = side
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


@dataclass
class BaseStates:
    """The base model's side of :func:`kl_drift` over one text set: per batch, the hidden states entering decoder
    block ``k`` (``B x T x d_model``, on the host; ``None`` for ``k = 0``), the tuple length the blocks return, and
    the base's last hidden states at the counted positions (``N x d_model``, on the host). ``checked``: the first
    batch was compared with the plain measure; ``plain``: they differed, and the plain measure is used instead.
    ``fingerprint``: the base weights'; ``inputs``: each batch's token ids and attention mask, which a stored batch
    must match to be used; ``path``: where the states are stored (``None``: not stored), ``stored``: the file
    holds every batch."""

    k: int
    batches: list = field(default_factory=list)
    checked: bool = False
    plain: bool = False
    fingerprint: str = ""
    inputs: list = field(default_factory=list)
    path: Path | None = None
    stored: bool = False


_MEMO: dict = {}  # one entry: the latest (model, base fingerprint, texts, batching) -> BaseStates


def base_states_path(fingerprint: str, texts: Sequence[str], max_len: int, batch_size: int, k: int) -> Path:
    """The cache file of the base's side of :func:`kl_drift` for the base weights of ``fingerprint`` over
    ``texts`` at ``max_len`` tokens in batches of ``batch_size``, the edit's lowest block being ``k``."""
    from ..models import cache_dir

    h = hashlib.sha256(json.dumps([max_len, batch_size, k]).encode())
    for t in texts:
        h.update(b"\0" + t.encode())
    return cache_dir() / "drift" / f"{fingerprint}-{h.hexdigest()[:24]}.safetensors"


def _load_states(states: BaseStates) -> None:
    """Fill ``states`` from its file when there is one (every batch, as the process that measured first wrote
    it); one line for a file that is not one, or that another crispedit version or another base wrote."""
    from ..safetensors_io import load_safetensors

    if states.path is None or not states.path.exists():
        return
    meta, tensors = load_safetensors(states.path, "KL drift base cache", _META_KEY)
    then = "delete it to measure the base again"
    check_written_by(meta, states.path, then, format=DRIFT_FORMAT)
    try:
        if meta["fingerprint"] != states.fingerprint or int(meta["k"]) != states.k:
            raise ValueError("made for other base weights")
        batches, inputs = [], []
        for j, tuple_len in enumerate(meta["tuple_lens"]):
            h = tensors[f"h.{j}"] if states.k else None
            batches.append((h, tuple_len, tensors[f"hb.{j}"]))
            inputs.append((tensors[f"ids.{j}"], tensors[f"attn.{j}"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CrispEditError(f"KL drift base cache {states.path} is malformed ({exc}); {then}") from None
    states.batches, states.inputs, states.checked, states.stored = batches, inputs, True, True


def _store_states(states: BaseStates) -> None:
    """Write ``states`` (every batch measured) to its file, atomically; a cache that cannot be written is skipped
    (the measure stands without it)."""
    from ..atomic import atomic_save_safetensors

    tensors = {}
    for j, ((h, _, hb), (ids, attn)) in enumerate(zip(states.batches, states.inputs)):
        if h is not None:
            tensors[f"h.{j}"] = h
        tensors.update({f"hb.{j}": hb, f"ids.{j}": ids, f"attn.{j}": attn})
    meta = stamped(
        {
            "format": DRIFT_FORMAT,
            "fingerprint": states.fingerprint,
            "k": states.k,
            "tuple_lens": [b[1] for b in states.batches],
        }
    )
    with contextlib.suppress(WriteError, OSError):
        atomic_save_safetensors(states.path, tensors, {_META_KEY: json.dumps(meta)})
        states.stored = True


def _base_states(
    model: nn.Module, base_weights: dict, texts: Sequence[str], max_len: int, batch_size: int
) -> BaseStates | None:
    """The kept :class:`BaseStates` for this model, base and texts (from this process's memo, else from the
    cache file, else a new, empty one), or ``None`` where the shortcut does not apply (a split model, parameters
    outside the decoder blocks, no separate output head)."""
    try:
        k = lowest_block(model, [parameter(model, n) for n in base_weights])
    except CrispEditError:  # not a decoder stack crispedit knows: the plain measure
        return None
    if k is None or is_sharded(model) or not hasattr(model, "get_output_embeddings"):
        return None
    if model.get_output_embeddings() is None:
        return None
    with swapped_weights(model, base_weights):
        fp = weight_fingerprint(model)
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    key = (id(model), fp, digest, max_len, batch_size)
    if key not in _MEMO:
        _MEMO.clear()
        states = BaseStates(k, fingerprint=fp, path=base_states_path(fp, texts, max_len, batch_size, k))
        _load_states(states)
        _MEMO[key] = states
    return _MEMO[key]


def _shared_log_probs(model: nn.Module, states: BaseStates, j: int, ids, attn, pos, base_weights: dict):
    """Next-token log-probabilities of the edited model and the base at the positions ``pos`` of batch ``j``, from
    the kept states (written now for a batch seen first)."""
    _, blocks = decoder_blocks(model)
    T = ids.shape[1]
    b, t = pos.nonzero(as_tuple=True)
    rows = b * T + t
    if j < len(states.inputs) and not (
        torch.equal(states.inputs[j][0], ids.cpu()) and torch.equal(states.inputs[j][1], attn.cpu())
    ):  # a stored batch of other tokens (another tokenizer): this batch and the rest are measured again
        del states.batches[j:], states.inputs[j:]
        states.stored = False
    if j == len(states.batches):
        h, tuple_len = (
            capture_block_input(model, blocks, states.k, input_ids=ids, attention_mask=attn)
            if states.k
            else (None, None)
        )
        with swapped_weights(model, base_weights), prefix_fed(blocks, states.k, passthroughs(states.k, tuple_len), h):
            hb = decoder_rows(model, rows, input_ids=ids, attention_mask=attn)
        states.batches.append((None if h is None else h.cpu(), tuple_len, hb.cpu()))
        states.inputs.append((ids.cpu(), attn.cpu()))
    h, tuple_len, hb = states.batches[j]
    h = None if h is None else h.to(ids.device)
    with prefix_fed(blocks, states.k, passthroughs(states.k, tuple_len), h):
        lp = torch.log_softmax(rows_logits(model, rows, input_ids=ids, attention_mask=attn), -1)
    return lp, torch.log_softmax(head_logits(model, hb.to(ids.device)), -1)


@torch.no_grad()
def kl_drift(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str],
    *,
    base_weights: dict[str, torch.Tensor] | None = None,
    base_model: nn.Module | None = None,
    max_len: int = 256,
    batch_size: int = 8,
    progress: bool | None = None,
    shared: bool = True,
) -> dict:
    """Mean per-token KL(base || model) (nats) and both perplexities on ``texts``; ``tokens``: the positions
    counted. With ``base_weights`` and ``shared`` the base's side is kept between calls (:class:`BaseStates`)."""
    if (base_weights is None) == (base_model is None):
        raise ValueError("give exactly one of base_weights or base_model")
    device = next(model.parameters()).device
    kl_sum, nll_base, nll_model, n = 0.0, 0.0, 0.0, 0
    was_training = model.training
    model.eval()
    try:
        states = _base_states(model, base_weights, texts, max_len, batch_size) if shared and base_weights else None
        for j, i in enumerate(
            tqdm(
                range(0, len(texts), batch_size), desc="KL drift", disable=(None if progress is None else not progress)
            )
        ):
            ids, attn = _encode(tokenizer, texts[i : i + batch_size], max_len, device)
            pos = loss_positions(attn)
            labels = ids[:, 1:][pos]
            if states is not None and not states.plain:
                lp, lq = _shared_log_probs(model, states, j, ids, attn, pos, base_weights)
                if not states.checked:  # the first batch of a new base: the shortcut against the plain measure
                    plain = _log_probs(model, ids, attn, pos, base_weights, None)
                    states.checked = True
                    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip((lp, lq), plain)):
                        states.plain, states.batches = True, []
                        lp, lq = plain
            else:
                lp, lq = _log_probs(model, ids, attn, pos, base_weights, base_model)
            kl_sum += float((lq.exp() * (lq - lp)).sum())
            nll_model -= float(lp.gather(-1, labels[:, None]).sum())
            nll_base -= float(lq.gather(-1, labels[:, None]).sum())
            n += int(pos.sum())
        if states is not None and not states.plain and not states.stored and states.path is not None:
            if len(states.batches) == -(-len(texts) // batch_size):
                _store_states(states)
    finally:
        model.train(was_training)
    return {
        "kl_drift": kl_sum / max(n, 1),
        "ppl": math.exp(nll_model / max(n, 1)),
        "ppl_base": math.exp(nll_base / max(n, 1)),
        "tokens": n,
    }


def _log_probs(
    model: nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    pos: torch.Tensor,
    base_weights: dict[str, torch.Tensor] | None,
    base_model: nn.Module | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities (float32, ``N x V`` at the ``N`` True positions of ``pos``, ``B x T-1``) of
    ``model`` as it is and of the base: ``base_model``, or ``model`` with ``base_weights`` swapped in."""
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)[pos]
    if base_model is not None:
        bdev = next(base_model.parameters()).device
        blog = base_model(input_ids=ids.to(bdev), attention_mask=attn.to(bdev)).logits[:, :-1].float().to(ids.device)
    else:
        with swapped_weights(model, base_weights):
            blog = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return lp, torch.log_softmax(blog, -1)[pos]


@torch.no_grad()
def answer_kl(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    starts: Sequence[int],
    *,
    base: dict[str, torch.Tensor] | nn.Module,
    pad_id: int = 0,
    batch_size: int = 8,
) -> dict:
    """Mean per-token KL(base || model) (nats) over the answer tokens of token-id ``sequences``: the positions
    predicting token ``starts[i]`` or later of sequence ``i`` (e.g. a chat prompt's tokens, then the base model's
    own answer from ``starts[i]`` on). ``base``: a second model, or weights (full name -> tensor) swapped into
    ``model``. Returns
    ``{"kl": nats per answer token, "tokens": answer tokens counted}``."""
    if len(sequences) != len(starts):
        raise ValueError(f"{len(starts)} answer starts for {len(sequences)} sequences")
    device = next(model.parameters()).device
    kl_sum, n = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(sequences), batch_size):
            rows, first = sequences[i : i + batch_size], starts[i : i + batch_size]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, : len(r)], attn[b, : len(r)] = torch.tensor(list(r), dtype=torch.long), 1
            pos = loss_positions(attn) & (torch.arange(width - 1)[None, :] >= torch.tensor(first)[:, None] - 1)
            ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
            lp, lq = (
                _log_probs(model, ids, attn, pos, base, None)
                if isinstance(base, dict)
                else _log_probs(model, ids, attn, pos, None, base)
            )
            kl_sum += float((lq.exp() * (lq - lp)).sum())
            n += int(pos.sum())
    finally:
        model.train(was_training)
    return {"kl": kl_sum / max(n, 1), "tokens": n}


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer, texts: Sequence[str], max_len: int = 256, batch_size: int = 8) -> float:
    """exp(mean next-token NLL, nats) over the non-padding tokens of ``texts`` (each cut to ``max_len``)."""
    device = next(model.parameters()).device
    nll, n = 0.0, 0
    for i in range(0, len(texts), batch_size):
        ids, attn = _encode(tokenizer, texts[i : i + batch_size], max_len, device)
        pos = loss_positions(attn)
        lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)[pos]
        nll -= float(lp.gather(-1, ids[:, 1:][pos][:, None]).sum())
        n += int(pos.sum())
    return math.exp(nll / max(n, 1))
