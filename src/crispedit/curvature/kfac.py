"""K-FAC factor collection.

For a linear layer ``s = W a`` (``W``: ``d_out x d_in``) K-FAC approximates its Gauss-Newton block by
``A (x) S`` with ``A = E[a a^T]`` over layer inputs and ``S = E[g g^T]`` over pre-activation gradients
``g = d loss / d s``. Expectations are per row: per token for language models (cross-token terms are
ignored, as in the paper and the authors' code), per spatial patch for convolutions (the standard
"KFC" treatment: unfolded patches are the inputs).

Pieces, kept apart so they snap together:

* :class:`FactorAccumulator` sums ``a a^T`` and ``g g^T`` rows in float64 (each batch's products are
  formed in ``stat_dtype``, float32 by default, then added to the float64 running sums).
* :func:`capture_io` hooks a set of modules, records their inputs and output gradients during one
  forward/backward, and makes the lowest hooked output the leaf of the graph, so that with all
  parameters frozen backward stops there and computes no parameter gradients.
* :func:`collect_lm_kfac` runs one pass over a text corpus for every chosen layer at once; under
  ``torch.distributed`` each process takes every ``world_size``-th batch and the unnormalised sums and
  row counts are all-reduced before the division (:meth:`FactorAccumulator.all_reduce`).
* What one pass does, and nothing more: texts are tokenised once and grouped by length
  (:func:`plan_batches`, ``max_padding`` bounds the padded share of a batch); the model runs without a KV
  cache; the LM head sees only the positions that carry loss, and when it is a plain linear map
  (:func:`plain_head`) the gradient of the summed cross-entropy with respect to the final hidden states is
  formed directly as ``(softmax(z) - onehot(y)) W``, a few sequences at a time (:func:`lm_backward`), so no
  ``N x V`` log-softmax graph is kept; backward stops at the lowest hooked layer.

Labels: ``sampled`` draws each position's label from the model's own predictive distribution
(Monte-Carlo Fisher = Gauss-Newton for softmax cross-entropy, what the paper's Bregman argument
needs); ``empirical`` uses the text's next token (empirical Fisher, what the authors' code does).
Padding is excluded through the attention mask, never by token id.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..distributed import all_agree, all_reduce_sum_, is_distributed, is_sharded, rank, world_size
from ..forward_args import static_attention_mask
from .factors import KFACFactors

__all__ = [
    "LabelMode",
    "FactorAccumulator",
    "add_gram_",
    "capture_io",
    "head_on_rows",
    "layer_rows",
    "sample_labels",
    "collect_lm_kfac",
    "collect_lm_input_covariance",
    "plan_batches",
    "LMBatch",
    "lm_batches",
    "lm_row_logits",
    "lm_labels",
    "plain_head",
    "lm_backward",
]


class LabelMode(str, Enum):
    """Where the labels behind ``S`` come from: ``sampled`` from the model's own predictive distribution
    (Monte-Carlo Fisher = Gauss-Newton), ``empirical`` the text's next token (empirical Fisher)."""

    SAMPLED = "sampled"
    EMPIRICAL = "empirical"


def add_gram_(acc: Tensor, x: Tensor, panel: int = 256) -> Tensor:
    """``acc += x^T x`` in place (``acc``: ``d x d``, usually float64; ``x``: ``N x d``, products formed in
    ``x``'s dtype and widened as they are added). Only the upper block triangle is computed — one GEMM per
    ``panel``-row strip, ``x[:, i:i+p]^T x[:, i:]`` — and mirrored, which saves up to half the FLOPs of
    ``x^T x`` for wide layers. Returns ``acc``."""
    d = x.shape[1]
    if d <= panel:
        acc += x.T @ x
        return acc
    for i0 in range(0, d, panel):
        i1 = min(d, i0 + panel)
        blk = x[:, i0:i1].T @ x[:, i0:]          # (i1 - i0) x (d - i0): this strip's diagonal block and right of it
        acc[i0:i1, i0:] += blk
        if i1 < d:
            acc[i1:, i0:i1] += blk[:, i1 - i0:].T
    return acc


class FactorAccumulator:
    """Running sums of ``a a^T`` and ``g g^T`` over rows, in float64."""

    def __init__(self, stat_dtype: torch.dtype = torch.float32):
        self.stat_dtype = stat_dtype
        self.A: dict[str, Tensor] = {}
        self.S: dict[str, Tensor] = {}
        self.rows: dict[str, int] = {}

    def add(self, name: str, a: Tensor, g: Tensor) -> None:
        """Add rows ``a`` (``N x d_in``) and ``g`` (``N x d_out``) of one layer."""
        if a.shape[0] != g.shape[0]:
            raise ValueError(f"{name}: {a.shape[0]} input rows but {g.shape[0]} gradient rows")
        if a.shape[0] == 0:
            return
        a = a.to(self.stat_dtype)
        g = g.to(self.stat_dtype)
        if name not in self.A:
            self.A[name] = torch.zeros(a.shape[1], a.shape[1], dtype=torch.float64, device=a.device)
            self.S[name] = torch.zeros(g.shape[1], g.shape[1], dtype=torch.float64, device=g.device)
            self.rows[name] = 0
        add_gram_(self.A[name], a)
        add_gram_(self.S[name], g)
        self.rows[name] += a.shape[0]

    def all_reduce(self, shapes: dict[str, tuple[int, int]], device: torch.device | str) -> None:
        """Sum the running sums and row counts over every process of the default ``torch.distributed``
        group, in place (nothing in a single process). ``shapes`` maps each layer, in the same order on
        every process, to ``(d_out, d_in)``: a process that saw no rows of a layer contributes zero
        ``d_in x d_in`` / ``d_out x d_out`` float64 sums on ``device``. Layers no process saw stay absent."""
        if not is_distributed():
            return
        names = list(shapes)
        rows = torch.tensor([self.rows.get(n, 0) for n in names], dtype=torch.int64, device=device)
        all_reduce_sum_(rows)
        for i, name in enumerate(names):
            d_out, d_in = shapes[name]
            A = self.A.get(name, torch.zeros(d_in, d_in, dtype=torch.float64, device=device))
            S = self.S.get(name, torch.zeros(d_out, d_out, dtype=torch.float64, device=device))
            all_reduce_sum_(A)
            all_reduce_sum_(S)
            if int(rows[i]) > 0:
                self.A[name], self.S[name], self.rows[name] = A, S, int(rows[i])

    def factors(self, layers: Sequence[str], meta: dict | None = None,
                out_dtype: torch.dtype = torch.float32) -> KFACFactors:
        """The averaged factors of ``layers``: ``A = Σ a aᵀ / rows`` (``d_in x d_in``) and ``S = Σ g gᵀ / rows``
        (``d_out x d_out``) per layer, in ``out_dtype`` on the CPU; ``n_tokens`` is the largest row count.
        Raises ``RuntimeError`` when a layer saw no rows."""
        missing = [n for n in layers if n not in self.A]
        if missing:
            raise RuntimeError(f"no statistics were collected for {missing} (no valid tokens?)")
        counts = {self.rows[n] for n in layers}
        n = max(counts)
        A = {k: (self.A[k] / self.rows[k]).to(out_dtype).cpu() for k in layers}
        S = {k: (self.S[k] / self.rows[k]).to(out_dtype).cpu() for k in layers}
        return KFACFactors(A, S, n, dict(meta or {}))


# ---------------------------------------------------------------------------------------------
# hooks


def layer_rows(module: nn.Module, inp: Tensor) -> Tensor:
    """Inputs of ``module`` as rows ``a`` such that the layer computes ``W_mat a`` per row.

    Linear / Conv1D keep their leading dims (``... x d_in``); Conv2d inputs are unfolded into patches
    (``B x L x C_in k_h k_w``) matching ``weight.reshape(C_out, -1)``.
    """
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(inp, module.kernel_size, dilation=module.dilation, padding=module.padding,
                           stride=module.stride)
        return patches.transpose(1, 2)
    return inp


def _grad_rows(module: nn.Module, grad: Tensor) -> Tensor:
    if isinstance(module, nn.Conv2d):
        return grad.flatten(2).transpose(1, 2)  # B x L x C_out
    return grad


@dataclass
class _Captured:
    inputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)


@contextlib.contextmanager
def capture_io(modules: dict[str, nn.Module]) -> Iterator[dict[str, _Captured]]:
    """Record inputs (as rows, see :func:`layer_rows`) and output gradients of ``modules``.

    A module output that does not require grad (the lowest hooked layer when all parameters are
    frozen) is replaced by a detached leaf that does, so backward runs from the loss down to the
    lowest hooked layer only.
    """
    store = {name: _Captured() for name in modules}
    handles = []

    def make_hook(name: str, module: nn.Module) -> Callable:
        """A forward hook recording the input rows and output gradients of layer ``name`` into ``store``."""
        def hook(mod, args, output):
            """Forward hook: record the input rows of ``name`` and hook its output's gradient (the output made
            a grad-requiring leaf first if need be); returns that output."""
            store[name].inputs.append(layer_rows(mod, args[0].detach()))
            if not output.requires_grad:
                output = output.detach().requires_grad_(True)

            def grad_hook(g: Tensor) -> None:
                """Tensor hook: record the output gradient ``g`` of ``name`` as rows (``... x d_out``)."""
                store[name].grads.append(_grad_rows(mod, g.detach()))

            output.register_hook(grad_hook)
            return output

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(make_hook(name, module)))
        yield store
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Temporarily set ``requires_grad=False`` on every parameter."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


# ---------------------------------------------------------------------------------------------
# language models


def _seq_seed(seed: int, index: int) -> int:
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample_labels(logits: Tensor, seed: int, index: int) -> Tensor:
    """Labels drawn from ``softmax(logits)`` (``T x V``) with a generator of ``logits``' device seeded by (seed,
    sequence index): the same sequence gets the same labels whatever the batching (drawn where the logits are, so
    a GPU collection moves no logits to the host; a GPU's random stream differs from the CPU's, so factors
    collected on a GPU are another sample of the same statistics, not the CPU's bit for bit).

    Drawn by inversion: one uniform per position against the float64 cumulative distribution (``T x V``), the
    label the first entry above it — exactly categorical, and on a CPU far cheaper than ``torch.multinomial``,
    which draws an exponential variate per vocabulary entry."""
    gen = torch.Generator(device=logits.device).manual_seed(_seq_seed(seed, index))
    cdf = torch.softmax(logits.detach().float(), dim=-1).double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[1] - 1).squeeze(-1)


def loss_positions(attention_mask: Tensor) -> Tensor:
    """Positions ``t`` that predict a real next token: ``mask[t] and mask[t+1]`` (B x T-1)."""
    m = attention_mask.bool()
    return m[:, :-1] & m[:, 1:]


def plan_batches(lengths: Sequence[int], batch_size: int, max_padding: float | None = 0.25) -> list[list[int]]:
    """Group sequence indices into batches of at most ``batch_size`` sequences.

    ``max_padding=None`` keeps the corpus order in consecutive chunks (``[0..b-1], [b..2b-1], ...``).
    A float sorts the sequences by decreasing length (ties keep corpus order) and fills batches in that
    order, closing a batch early when adding the next sequence would make more than that fraction of
    its ``n_seqs x longest`` token slots padding (``0`` = only equal lengths share a batch). Sequences
    shorter than 2 tokens carry no next-token loss and are left out of every batch. Returns lists of
    indices into ``lengths``; the plan depends on nothing but its arguments (every process of a
    distributed run computes the same one)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_padding is not None and not 0.0 <= max_padding < 1.0:
        raise ValueError(f"max_padding must be in [0, 1), got {max_padding}")
    useful = [i for i, n in enumerate(lengths) if n >= 2]
    if max_padding is None:
        return [useful[i:i + batch_size] for i in range(0, len(useful), batch_size)]
    order = sorted(useful, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        if cur:
            longest = lengths[cur[0]]
            pad = 1.0 - (real + lengths[i]) / ((len(cur) + 1) * longest)
            if len(cur) == batch_size or pad > max_padding:
                batches.append(cur)
                cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        batches.append(cur)
    return batches


@dataclass
class LMBatch:
    """One right-padded batch of tokenised texts.

    ``indices``: corpus index of each row (what seeds its sampled labels); ``input_ids`` and
    ``attention_mask``: ``B x T`` (``mask``: what the model is fed,
    :func:`~crispedit.forward_args.static_attention_mask`);
    ``rows``: ``B x T`` bool, position ``t`` predicts a real next token
    (:func:`loss_positions` with a False last column); ``labels``: ``N`` next-token ids of the ``N`` True
    positions of ``rows`` in row-major order (sequence by sequence, each a prefix of its row); ``flat``: their
    flat row-major indices (``N``, on the batch's device), ``counts``: the loss rows per sequence (host
    ints) and ``padded``: whether any row is padded, derived from ``rows`` / the mask when not given."""

    indices: list[int]
    input_ids: Tensor
    attention_mask: Tensor
    rows: Tensor
    labels: Tensor
    flat: Tensor | None = None
    counts: list[int] | None = None
    padded: bool | None = None

    def __post_init__(self) -> None:
        # what the collection needs from ``rows`` on the host, computed once: no step of it reads ``rows`` back
        if self.counts is None:
            self.counts = self.rows.sum(1).tolist()
        if self.flat is None:
            self.flat = self.rows.reshape(-1).nonzero().squeeze(1)
        if self.padded is None:
            self.padded = bool((self.attention_mask == 0).any())

    def take(self, x: Tensor) -> Tensor:
        """The loss rows of ``x`` (``B x T x ...``): ``x[rows]``, ``N x ...`` in row-major order, by index (no
        value read back to the host)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.flat)

    @property
    def n_rows(self) -> int:
        """Number of loss positions (K-FAC rows) in the batch."""
        return int(self.labels.numel())


def lm_batches(tokenizer, texts: Sequence[str] | Sequence[Sequence[int]], *, max_len: int, batch_size: int,
               max_padding: float | None = 0.25, device: torch.device | str = "cpu",
               loss_from: Sequence[int] | None = None) -> list[LMBatch]:
    """Tokenise ``texts`` once (truncated to ``max_len`` tokens, the tokenizer's special tokens included;
    sequences of token ids are taken as they are, truncated the same way) and group them with
    :func:`plan_batches`; each batch is right-padded with the tokenizer's pad id (masking comes from the
    attention mask, never from the token id) and put on ``device``. ``loss_from`` (one int per text): only
    the positions predicting token ``loss_from[i]`` or later of text ``i`` are loss rows (a prompt's tokens
    left out); default every position with a real next token."""
    ids = _token_ids(tokenizer, texts, max_len)
    if loss_from is not None and len(loss_from) != len(ids):
        raise ValueError(f"loss_from has {len(loss_from)} entries for {len(ids)} texts")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = []
    for idx in plan_batches([len(x) for x in ids], batch_size, max_padding):
        T = max(len(ids[i]) for i in idx)
        input_ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        for r, i in enumerate(idx):
            input_ids[r, :len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            attn[r, :len(ids[i])] = 1
        rows = torch.zeros((len(idx), T), dtype=torch.bool)
        rows[:, :-1] = loss_positions(attn)
        if loss_from is not None:  # position t predicts token t + 1
            first = torch.tensor([max(int(loss_from[i]) - 1, 0) for i in idx])
            rows &= torch.arange(T)[None, :] >= first[:, None]
        labels = input_ids[:, 1:][rows[:, :-1]]
        flat = rows.reshape(-1).nonzero().squeeze(1)
        out.append(LMBatch(list(idx), input_ids.to(device), attn.to(device), rows.to(device), labels.to(device),
                           flat.to(device), rows.sum(1).tolist(), bool((attn == 0).any())))
    return out


def _token_ids(tokenizer, texts, max_len: int) -> list[list[int]]:
    """Token ids of ``texts`` (strings are tokenised, id sequences copied), each truncated to ``max_len``."""
    texts = list(texts)
    if all(isinstance(t, str) for t in texts):
        return tokenizer(texts, truncation=True, max_length=max_len)["input_ids"] if texts else []
    if any(isinstance(t, str) for t in texts):
        raise TypeError("texts must be all strings or all token-id sequences")
    return [[int(x) for x in t][:max_len] for t in texts]


@contextlib.contextmanager
def head_on_rows(model: nn.Module, rows: Tensor, skip: Sequence[nn.Module] = ()) -> Iterator[bool]:
    """Feed the output embedding (LM head) only the hidden states at ``rows`` (``B x T`` bool), as one
    ``1 x N x H`` sequence, so that the ``V``-wide logits are formed for the ``N`` loss positions only.
    Yields whether the head was found (a model without ``get_output_embeddings``, or whose head is in
    ``skip``, runs unchanged)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or any(head is m for m in skip):
        yield False
        return

    def pre(mod, args):
        """Forward pre-hook: feed the head ``h[rows]`` as one ``1 x N x H`` sequence when the hidden states are
        ``B x T x H`` with ``B x T`` the shape of ``rows``; otherwise leave the input unchanged."""
        h = args[0]
        if h.dim() != 3 or tuple(h.shape[:2]) != tuple(rows.shape):
            return None
        return (h[rows].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(pre)
    try:
        yield True
    finally:
        handle.remove()


def lm_row_logits(model: nn.Module, batch: LMBatch, skip: Sequence[nn.Module] = ()) -> Tensor:
    """Float32 (or wider) next-token logits ``N x V`` of ``model`` at the ``N`` loss positions of ``batch``
    (row-major order, as ``batch.labels``). The LM head runs on those positions only when the model
    exposes it (:func:`head_on_rows`); otherwise the full ``B x T x V`` logits are formed and gathered."""
    n = batch.n_rows
    with head_on_rows(model, batch.rows, skip):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    if (logits.dim() == 3 and logits.shape[0] == 1 and logits.shape[1] == n
            and tuple(logits.shape[:2]) != tuple(batch.rows.shape)):
        logits = logits.squeeze(0)  # a view: its backward copies nothing
    elif logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(batch.rows.shape):
        logits = logits[batch.rows]
    else:
        raise RuntimeError(f"unexpected logits shape {tuple(logits.shape)} for a batch of shape "
                           f"{tuple(batch.rows.shape)}")
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def lm_labels(logits: Tensor, batch: LMBatch, label_mode: LabelMode, seed: int) -> Tensor:
    """Labels of the ``N`` rows: the text's next tokens (empirical) or draws from ``softmax(logits)`` seeded
    per (``seed``, corpus index) with :func:`sample_labels` (sampled; the same whatever the batching)."""
    if label_mode is LabelMode.EMPIRICAL:
        return batch.labels
    parts, off = [], 0
    for idx, c in zip(batch.indices, batch.counts):
        parts.append(sample_labels(logits[off:off + c], seed, idx))
        off += c
    return torch.cat(parts)


def plain_head(model: nn.Module, batch: LMBatch, skip: Sequence[nn.Module] = ()) -> nn.Module | None:
    """The model's LM head if its logits are exactly ``F.linear(h, head.weight, head.bias)`` of the final
    hidden states (no soft-capping, scaling or other post-processing), else None. Checked by a no-grad probe
    on the first 8 tokens of ``batch``'s first sequence; a head in ``skip`` (a hooked layer) gives None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(weight, Tensor) or weight.dim() != 2 or any(head is m for m in skip):
        return None
    seen = []
    h = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            t = min(8, batch.input_ids.shape[1])
            logits = model(input_ids=batch.input_ids[:1, :t], attention_mask=batch.attention_mask[:1, :t],
                           use_cache=False).logits
            if len(seen) != 1 or seen[0].dim() != 3:
                return None
            mine = F.linear(seen[0], weight, getattr(head, "bias", None))
    finally:
        h.remove()
    if mine.shape != logits.shape:
        return None
    ok = torch.allclose(mine.float(), logits.float(), rtol=1e-4, atol=1e-4 * float(logits.float().abs().max()) + 1e-6)
    return head if ok else None


@contextlib.contextmanager
def _hidden_at_rows(head: nn.Module, batch: LMBatch) -> Iterator[list[Tensor]]:
    """While active, ``head`` (the LM head) records the final hidden states at ``batch``'s loss rows (``N x H``,
    still in the autograd graph) and is fed an empty sequence instead, so the model forms no logits at all."""
    out: list[Tensor] = []

    def pre(mod, args):
        """Forward pre-hook: record ``h[rows]`` (``N x H``) and feed the head the empty ``B x 0 x H`` instead."""
        h = args[0]
        out.append(batch.take(h))
        return (h[:, :0], *args[1:])

    handle = head.register_forward_pre_hook(pre)
    try:
        yield out
    finally:
        handle.remove()


def _ce_grad_rows(hidden: Tensor, head: nn.Module, batch: LMBatch, label_mode: LabelMode, seed: int,
                  chunk_rows: int = 2048) -> Tensor:
    """Gradient of the summed next-token cross-entropy with respect to the final hidden states at the loss
    rows, ``N x H``: ``(softmax(z) - onehot(y)) W`` with ``z = hidden W^T (+ b)`` formed in float32, a few
    whole sequences (at most ``chunk_rows`` rows unless one sequence is longer) at a time, the one-hot
    subtracted in place from the softmax (the only ``n x V`` buffers are ``z`` and its softmax, one chunk each).
    Labels as :func:`lm_labels` (sampled ones drawn from each sequence's own float32 logits)."""
    W, bias = head.weight, getattr(head, "bias", None)
    counts = batch.counts
    grads, start, i = [], 0, 0
    while i < len(counts):
        j, n = i, 0
        while j < len(counts) and (n == 0 or n + counts[j] <= chunk_rows):
            n += counts[j]
            j += 1
        z = F.linear(hidden[start:start + n], W, bias).float()
        if label_mode is LabelMode.EMPIRICAL:
            y = batch.labels[start:start + n]
        else:
            parts, off = [], 0
            for idx, c in zip(batch.indices[i:j], counts[i:j]):
                parts.append(sample_labels(z[off:off + c], seed, idx))
                off += c
            y = torch.cat(parts)
        p = torch.softmax(z, dim=-1)
        del z
        p[torch.arange(n, device=p.device), y] -= 1.0
        grads.append(p.to(W.dtype) @ W)
        del p
        start, i = start + n, j
    return torch.cat(grads)


def lm_backward(model: nn.Module, batch: LMBatch, label_mode: LabelMode, seed: int,
                head: nn.Module | None = None, skip: Sequence[nn.Module] = ()) -> None:
    """Forward ``batch`` and backpropagate its summed next-token cross-entropy over the loss rows (parameters
    are expected frozen; whatever in the graph requires grad gets its gradient hooks called).

    With ``head`` (from :func:`plain_head`) the model stops before its LM head and the hidden-state gradient
    is formed directly by :func:`_ce_grad_rows` (no ``N x V`` log-softmax graph is kept); otherwise the
    logits at the loss rows (:func:`lm_row_logits`) go through ``F.cross_entropy`` and autograd."""
    if head is None:
        logits = lm_row_logits(model, batch, skip)
        F.cross_entropy(logits, lm_labels(logits, batch, label_mode, seed), reduction="sum").backward()
        return
    with _hidden_at_rows(head, batch) as hidden:
        model(input_ids=batch.input_ids,
              attention_mask=static_attention_mask(model, batch.attention_mask, batch.padded),
              use_cache=False)
    (h,) = hidden
    if h.requires_grad:
        with torch.profiler.record_function("crispedit.kfac.head_grad"):
            dh = _ce_grad_rows(h.detach(), head, batch, label_mode, seed)
        h.backward(dh)


def _process_batches(batches: list, shard: bool, split: bool) -> tuple[list, int]:
    """The batches this process runs — every ``w``-th from its rank when ``shard``, else all — and how many of them
    at the end are repeats whose statistics it discards: with the model ``split`` every process runs as many
    batches (FSDP gathers each block in every forward and backward), so one with fewer runs its last (or the
    first) batch again."""
    mine = batches[rank()::world_size()] if shard else batches
    if not split:
        return mine, 0
    idle = -(-len(batches) // world_size()) - len(mine)
    return mine + [mine[-1] if mine else batches[0]] * idle, idle


def collect_lm_kfac(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str] | Sequence[Sequence[int]],
    layers: dict[str, nn.Module],
    *,
    max_len: int = 256,
    batch_size: int = 8,
    label_mode: LabelMode | str = LabelMode.SAMPLED,
    seed: int = 0,
    stat_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    desc: str = "K-FAC",
    distributed: bool | None = None,
    max_padding: float | None = 0.25,
    loss_from: Sequence[int] | None = None,
) -> KFACFactors:
    """K-FAC factors of the next-token loss of ``model`` on ``texts`` for all ``layers`` in one pass:
    ``A`` (``d_in x d_in``) and ``S`` (``d_out x d_out``) per layer, in ``out_dtype``.

    Each text is tokenised once (truncated to ``max_len``; token-id sequences are used as given); texts are
    grouped into right-padded batches of at most ``batch_size`` by :func:`plan_batches` (by length, at most
    ``max_padding`` of a batch padding; ``None`` keeps corpus order). Every position with a real next token
    (with ``loss_from``, only those predicting token ``loss_from[i]`` or later of text ``i``: :func:`lm_batches`)
    contributes one row to ``A`` and ``S``; factors are divided by the number of such rows, so the batching
    changes nothing but the order of the float64 additions. The LM head and the loss are computed at those positions
    only, and backward stops at the lowest hooked layer (:func:`capture_io`).

    ``distributed`` (default: whether a ``torch.distributed`` group of several processes is initialised):
    process ``r`` of ``w`` runs batches ``r, r + w, r + 2w, ...`` of the same plan (sampled labels are
    seeded by the corpus index of each sequence), then the float64 sums of ``a a^T``, ``g g^T`` and the row
    counts are summed over the processes (:meth:`FactorAccumulator.all_reduce`) and normalised: every
    process returns the one-process factors up to the order of the float64 additions. Every process must
    call it with the same arguments. On a model split across the processes
    (:func:`crispedit.distributed.shard_model`) every process runs the same number of forward and backward
    passes: one with a batch fewer repeats one and discards its statistics.
    """
    label_mode = LabelMode(label_mode)
    device = next(model.parameters()).device
    acc = FactorAccumulator(stat_dtype)
    was_training = model.training
    model.eval()
    batches = lm_batches(tokenizer, texts, max_len=max_len, batch_size=batch_size, max_padding=max_padding,
                         device=device, loss_from=loss_from)
    shard = distributed if distributed is not None else is_distributed()
    split = shard and is_sharded(model)
    mine, idle = _process_batches(batches, shard, split)
    quiet = True if rank() != 0 else (None if progress is None else not progress)  # one bar: rank 0's
    bar = tqdm(total=sum(len(b.indices) for b in mine[:len(mine) - idle]), desc=desc, unit="seq", disable=quiet)
    skip = list(layers.values())
    try:
        with frozen(model):
            head = plain_head(model, mine[0], skip) if mine else None
            if split and not all_agree(head is not None):
                head = None  # the processes take the same path
            for i, batch in enumerate(mine):
                with capture_io(layers) as store:
                    lm_backward(model, batch, label_mode, seed, head, skip)
                if i >= len(mine) - idle:
                    continue
                with torch.profiler.record_function("crispedit.kfac.statistics"):
                    for name in layers:
                        cap = store[name]
                        if len(cap.inputs) != 1 or len(cap.grads) != 1:
                            raise RuntimeError(f"layer {name} was called {len(cap.inputs)} times in one forward")
                        acc.add(name, batch.take(cap.inputs[0]), batch.take(cap.grads[0]))
                bar.update(len(batch.indices))
    finally:
        bar.close()
        model.train(was_training)
    if shard:
        from ..layers import weight_matrix

        acc.all_reduce({name: tuple(weight_matrix(m).shape) for name, m in layers.items()}, device)
    meta = {"label_mode": label_mode.value, "seed": seed, "max_len": max_len, "n_texts": len(texts)}
    return acc.factors(list(layers), meta, out_dtype=out_dtype)


class _StopForward(Exception):
    """Raised by a hook once the highest needed layer has run: the rest of the forward is skipped."""


def _covariance_batches(tokenizer, texts, max_len: int, batch_size: int, loss_from: Sequence[int] | None,
                        device) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """``(input_ids, attention_mask, counted)`` (``B x T``) batches of ``texts`` in corpus order: every non-padding
    token counted, or — with ``loss_from`` — the loss rows :func:`lm_batches` gives."""
    if loss_from is None:
        for b in range(0, len(texts), batch_size):
            enc = tokenizer(list(texts[b:b + batch_size]), return_tensors="pt", padding=True, truncation=True,
                            max_length=max_len)
            mask = enc["attention_mask"].to(device)
            yield enc["input_ids"].to(device), mask, mask.bool()
        return
    for batch in lm_batches(tokenizer, texts, max_len=max_len, batch_size=batch_size, max_padding=None,
                            device=device, loss_from=loss_from):
        yield batch.input_ids, batch.attention_mask, batch.rows


def collect_lm_input_covariance(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str] | Sequence[Sequence[int]],
    layers: dict[str, nn.Module],
    *,
    max_len: int = 256,
    batch_size: int = 8,
    stat_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    desc: str = "input covariance",
    loss_from: Sequence[int] | None = None,
) -> KFACFactors:
    """The uncentred input covariance ``C = E[k kᵀ]`` (``d_in x d_in``) of every layer in ``layers`` over
    every non-padding token of ``texts`` (tokenised, truncated to ``max_len``, right-padded): MEMIT's
    ``mom2`` statistic, K-FAC's ``A`` without the loss. Forward only, no labels, no gradients; the forward
    stops once the last of ``layers`` has run. Products in ``stat_dtype``, sums in float64, divided by
    the token count; returned as :class:`KFACFactors` with ``A`` only (``S`` empty). In several
    processes every process runs every batch (no sharding). With ``loss_from`` (one int per text; ``texts`` may
    then be token-id sequences) only the positions that :func:`lm_batches` counts for it are taken: those
    predicting token ``loss_from[i]`` or later of text ``i``."""
    device = next(model.parameters()).device
    order = {id(m): i for i, m in enumerate(model.modules())}
    last = max(layers.values(), key=lambda m: order[id(m)])
    sums: dict[str, Tensor] = {}
    rows = 0
    was_training = model.training
    model.eval()
    pad_side = getattr(tokenizer, "padding_side", "right")
    tokenizer.padding_side = "right"
    bar = tqdm(total=len(texts), desc=desc, unit="seq", disable=(None if progress is None else not progress))
    mask: Tensor | None = None

    def make_hook(name: str, module: nn.Module):
        """A forward hook adding layer ``name``'s input products to ``sums[name]``."""
        def hook(mod, args, output):
            """Forward hook: add ``aᵀ a`` (float64, ``d_in x d_in``) of the non-padding input rows ``a`` to
            ``sums[name]``; stops the forward (:class:`_StopForward`) after the last layer."""
            a = layer_rows(mod, args[0].detach())[mask].to(stat_dtype)
            aa = (a.T @ a).to(torch.float64)
            sums[name] = sums[name] + aa if name in sums else aa
            if mod is last:
                raise _StopForward
        return hook

    handles = [m.register_forward_hook(make_hook(n, m)) for n, m in layers.items()]
    try:
        with frozen(model), torch.no_grad():
            for ids, attn, mask in _covariance_batches(tokenizer, texts, max_len, batch_size, loss_from, device):
                try:
                    model(input_ids=ids, attention_mask=attn)
                except _StopForward:
                    pass
                rows += int(mask.sum())
                bar.update(ids.shape[0])
    finally:
        for h in handles:
            h.remove()
        bar.close()
        tokenizer.padding_side = pad_side
        model.train(was_training)
    if rows == 0 or set(sums) != set(layers):
        raise RuntimeError("no input statistics were collected (no tokens?)")
    A = {k: (sums[k] / rows).to(out_dtype).cpu() for k in layers}
    return KFACFactors(A, {}, rows, {"kind": "input", "max_len": max_len, "n_texts": len(texts)})
