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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..data.edits import EditRequest
from ..data.tokenize import collate, join_prompt_target, split_context_target
from ..errors import CrispEditError
from ..forward_parts import forward_until
from ..layers import decoder_blocks
from .delta_forward import DeltaForward, hidden_size, suffix_steps
from .fastpath import target_rows

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
    fwd = DeltaForward(model, block, enc, pos_t, torch.cat([t_rows, kl_at]), verdicts)
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
