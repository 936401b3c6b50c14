"""Running part of a model's forward, exactly: up to a module (:func:`forward_until`, :func:`capture_block_input`),
from a decoder block on with given input hidden states (:func:`prefix_fed`, the blocks below replaced by
pass-throughs) and the output head on chosen positions only (:func:`rows_logits`, :func:`head_logits`).

The edit loop's fast loss (:mod:`crispedit.editing.fastpath`), the closed-form editors' key/value shortcuts and the
KL drift on held-out text (:mod:`crispedit.evaluation.drift`) are built from these: the hidden states entering the
lowest block an edit changes do not change with the edit, so they are computed once and fed in after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from .layers import decoder_blocks

__all__ = [
    "no_cache_kwargs",
    "forward_until",
    "capture_block_input",
    "prefix_fed",
    "passthroughs",
    "rows_logits",
    "decoder_rows",
    "head_logits",
    "lowest_block",
]


def _up(x: Tensor) -> Tensor:
    """Loss maths in float32 or better."""
    return x if x.dtype == torch.float64 else x.float()


def no_cache_kwargs(model: nn.Module) -> dict:
    """``{"use_cache": False}`` for a model whose config has a KV-cache switch (Hugging Face), else ``{}``."""
    return {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}


class _Stop(Exception):
    pass


def _run_until_stopped(model: nn.Module, handles: list, inputs: dict) -> None:
    """One forward of ``model(**inputs)`` (no KV cache) that a hook may end by raising :class:`_Stop`; the hooks'
    ``handles`` are removed afterwards."""
    try:
        model(**inputs, **no_cache_kwargs(model))
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()


def forward_until(model: nn.Module, module: nn.Module, *, output: bool, **inputs) -> Tensor:
    """The first positional input (``output=False``) or the output hidden states (``output=True``; the first
    element of a tuple output) of ``module`` in one forward of ``model(**inputs)``, detached; the forward is
    stopped right there, so nothing above ``module`` (later blocks, the output head over every position) runs.
    Exact: the same tensor the full forward passes through ``module``. Shapes are ``module``'s
    (``B x T x d`` for a decoder block or a linear layer inside one)."""
    store: list[Tensor] = []

    def pre(mod, args):
        """Forward pre-hook: store the input and stop the forward."""
        store.append(args[0].detach())
        raise _Stop

    def post(mod, args, out):
        """Forward hook: store the output hidden states and stop the forward."""
        store.append((out[0] if isinstance(out, tuple) else out).detach())
        raise _Stop

    _run_until_stopped(
        model, [module.register_forward_hook(post) if output else module.register_forward_pre_hook(pre)], inputs
    )
    if not store:
        raise RuntimeError(f"{type(module).__name__} did not run in the model's forward")
    return store[0]


class _Passthrough(nn.Module):
    def __init__(self, tuple_len: int | None):
        super().__init__()
        self.tuple_len = tuple_len

    def forward(self, hidden_states, *args, **kwargs):
        """``hidden_states`` unchanged (as a ``tuple_len`` tuple padded with ``None`` if blocks return tuples)."""
        if self.tuple_len is None:
            return hidden_states
        return (hidden_states,) + (None,) * (self.tuple_len - 1)


def _replace_hidden(args, kwargs, h):
    if "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = h
        return args, kwargs
    return (h,) + tuple(args[1:]), kwargs


def capture_block_input(model: nn.Module, blocks: nn.ModuleList, k: int, **inputs) -> tuple[Tensor, int | None]:
    """The hidden states entering decoder block ``k`` (``B x T x d_model``, detached) for one forward of
    ``model(**inputs)``, stopped there, and the length of block ``k - 1``'s output tuple (``None`` when
    blocks return a bare tensor) for :class:`_Passthrough`. ``k ≥ 1``."""
    store: dict = {}

    def pre(mod, args, kwargs):
        """Forward pre-hook on block ``k``: store its input hidden states (detached) and stop the forward."""
        store["h"] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
        raise _Stop

    def post(mod, args, out):
        """Forward hook on block ``k - 1``: note the length of its output tuple (None if not a tuple)."""
        store["tuple_len"] = len(out) if isinstance(out, tuple) else None

    _run_until_stopped(
        model,
        [blocks[k].register_forward_pre_hook(pre, with_kwargs=True), blocks[k - 1].register_forward_hook(post)],
        inputs,
    )
    return store["h"], store.get("tuple_len")


@contextlib.contextmanager
def prefix_fed(blocks: nn.ModuleList, k: int, passthrough: Sequence[nn.Module], hidden: Tensor) -> Iterator[None]:
    """Within the block: decoder blocks ``0 .. k-1`` are the pass-throughs ``passthrough`` and block ``k``
    receives ``hidden`` (``B x T x d_model``, e.g. from :func:`capture_block_input`, possibly changed) as
    its input hidden states; everything else of the forward (embeddings, masks, rotary tables) runs as
    usual. ``k = 0`` changes nothing."""
    if k == 0:
        yield
        return
    saved = [blocks[i] for i in range(k)]
    hook = blocks[k].register_forward_pre_hook(
        lambda mod, args, kwargs: _replace_hidden(args, kwargs, hidden), with_kwargs=True
    )
    try:
        for i in range(k):
            blocks[i] = passthrough[i]
        yield
    finally:
        hook.remove()
        for i, b in enumerate(saved):
            blocks[i] = b


def lowest_block(model: nn.Module, params) -> int | None:
    """The lowest decoder block holding one of ``params`` (tensors of ``model``): the hidden states entering it do
    not depend on them. ``None`` when one of them lies outside the decoder blocks, or none is given."""
    prefix, blocks = decoder_blocks(model)
    trained = {id(p) for p in params}
    owners = [i for i, b in enumerate(blocks) if any(id(p) in trained for p in b.parameters())]
    outside = any(id(p) in trained and not n.startswith(prefix + ".") for n, p in model.named_parameters())
    return min(owners) if owners and not outside else None


def passthroughs(k: int, tuple_len: int | None) -> list[nn.Module]:
    """``k`` pass-through modules standing in for decoder blocks that return ``tuple_len``-tuples (or bare
    tensors when ``None``)."""
    return [_Passthrough(tuple_len) for _ in range(k)]


def head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """Logits (float32 or better) of final hidden states ``hidden`` (``R x d_model``, after the decoder's last
    norm): the output head, then the final logit soft-cap where the config has one. ``R x vocab``."""
    logits = _up(model.get_output_embeddings()(hidden))
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def decoder_rows(model: nn.Module, rows: Tensor, **inputs) -> Tensor | None:
    """The decoder's last hidden states (``R x d_model``) at the flat positions ``rows`` (indices into the
    row-major ``B x T`` positions) of ``model(**inputs)``, run without a KV cache unless ``inputs`` pass one;
    ``None`` when the model has no separate decoder and output head."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or head is None:
        return None
    hidden = base(**{**no_cache_kwargs(model), **inputs}).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)


def rows_logits(model: nn.Module, rows: Tensor, **inputs) -> Tensor:
    """Logits (float32 or better) of the flat positions ``rows`` (indices into the row-major ``B x T``
    positions) of ``model(**inputs)``: the decoder's last hidden states at those rows through the output
    head (:func:`head_logits`), so the head runs on those rows only. ``R x vocab``. Falls back to the full logits
    when the model has no separate decoder / head. Runs without a KV cache unless ``inputs`` pass one
    (``past_key_values``, ``use_cache``)."""
    hidden = decoder_rows(model, rows, **inputs)
    if hidden is None:
        logits = model(**{**no_cache_kwargs(model), **inputs}).logits
        return _up(logits.reshape(-1, logits.shape[-1]).index_select(0, rows))
    return head_logits(model, hidden)
