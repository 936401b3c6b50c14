"""What to pass a causal LM's forward so that it does less work: an attention mask built once for a padded
batch (no host read per forward), and the last position's logits only where a forward is run for its KV cache.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["takes_full_masks", "last_logits_only", "static_attention_mask"]


def takes_full_masks(model: nn.Module) -> bool:
    """Whether ``model`` runs PyTorch's scaled-dot-product attention with one full causal mask in every layer (no
    sliding window), so that a ``B x 1 x T x T`` boolean mask fed to it reaches every attention unchanged."""
    cfg = getattr(model, "config", None)
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    return (
        getattr(cfg, "_attn_implementation", None) == "sdpa"
        and not getattr(cfg, "sliding_window", None)
        and layer_types == {"full_attention"}
    )


def last_logits_only(model: nn.Module) -> dict:
    """``{"logits_to_keep": 1}`` where ``model.forward`` takes it (Hugging Face causal LMs), else ``{}``: keyword
    arguments for a forward whose output is wanted for its KV cache and last position only, so that the output
    projection (``vocab x d_model``, a large share of a small model's forward) skips every other position. The
    cache is the same either way."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def static_attention_mask(
    model: nn.Module, attention_mask: torch.Tensor, padded: bool | None = None, *, unpadded_mask: bool = False
) -> torch.Tensor | None:
    """The attention mask to feed ``model`` for a right-padded batch whose key mask is ``attention_mask``
    (``B x T``, 1 = token), built once so that no forward reads the mask back to the host (Hugging Face's mask
    code asks ``padding_mask.all()`` of every forward to choose its causal shortcut):

    * ``None`` when the batch has no padding (the model then takes its causal path, no mask at all) — unless
      ``unpadded_mask``: then, for a model that takes full masks, the plain causal mask below, because Hugging
      Face reads the position ids back to look for packed sequences in a forward given no mask;
    * the ``B x 1 x T x T`` boolean mask ``causal & key_mask`` (True = attend) for a model running PyTorch's
      scaled-dot-product attention with one full causal mask in every layer (no sliding window), which Hugging
      Face passes through unchanged;
    * ``attention_mask`` itself otherwise (the model builds its own masks, and reads).

    ``padded``: whether the batch has padding, when the caller knows it from the host (else read from the mask).

    The edit loop's fast path (:func:`crispedit.editing.fastpath.make_loss_fn`) checks its loss under this mask
    against the plain loss before using it; the K-FAC collection feeds it to every forward."""
    if not (bool((attention_mask == 0).any()) if padded is None else padded):
        if not (unpadded_mask and takes_full_masks(model)):
            return None
    elif not takes_full_masks(model):
        return attention_mask
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]
