"""The edit-loss shortcuts are exact: same loss and same gradients as a plain forward."""

import pytest
import torch

from crispedit.data.tokenize import encode_pairs
from crispedit.editing.fastpath import _FastLoss, make_loss_fn, plain_loss
from crispedit.layers import resolve_layers

PROMPTS = ["Who wrote the book?", "Where is the river located exactly?", "Q?"]
TARGETS = ["Author Name", "In the north", "A"]


def _grads(model, params, loss):
    for p in params.values():
        p.grad = None
    loss.backward()
    return {n: p.grad.clone() for n, p in params.items()}


@pytest.mark.parametrize("pattern,k", [("model.layers.{2-3}.mlp.down_proj", 2), ("model.layers.0.mlp.down_proj", 0)])
def test_fast_loss_equals_plain_llama(tiny_lm64, pattern, k):
    model, tok = tiny_lm64
    layers = resolve_layers(model, pattern)
    params = {n: m.weight for n, m in layers.items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    batches = [encode_pairs(tok, PROMPTS, TARGETS), encode_pairs(tok, PROMPTS[:1], TARGETS[:1])]
    fast = _FastLoss(model, params, batches)
    assert fast.k == k
    for i, b in enumerate(batches):
        lp, lf = plain_loss(model, b), fast(i, b)
        assert torch.allclose(lp, lf, rtol=1e-10)
        gp, gf = _grads(model, params, plain_loss(model, b)), _grads(model, params, fast(i, b))
        for n in gp:
            assert torch.allclose(gp[n], gf[n], rtol=1e-8, atol=1e-12)
    # blocks are restored after use
    assert all(type(b).__name__ == "LlamaDecoderLayer" for b in model.model.layers)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.5)  # trained weights may change: still exact
        assert torch.allclose(plain_loss(model, batches[0]), fast(0, batches[0]), rtol=1e-10)


def test_fast_loss_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = (
        GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(tok), n_embd=16, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
            )
        )
        .double()
        .eval()
    )
    layers = resolve_layers(model, "transformer.h.{2-3}.mlp.c_proj")
    params = {n: m.weight for n, m in layers.items()}
    batches = [encode_pairs(tok, PROMPTS, TARGETS)]
    loss_fn = make_loss_fn(model, params, batches)
    assert torch.allclose(loss_fn(0), plain_loss(model, batches[0]), rtol=1e-10)
    assert loss_fn.fast is True


def test_fast_loss_falls_back_when_the_model_transforms_logits(tiny_lm64):
    """A model whose forward post-processes logits (unknown to the shortcut) must get the plain loss."""
    model, tok = tiny_lm64
    layers = resolve_layers(model, "model.layers.{2-3}.mlp.down_proj")
    params = {n: m.weight for n, m in layers.items()}
    batches = [encode_pairs(tok, PROMPTS, TARGETS)]
    assert make_loss_fn(model, params, batches).fast is True
    orig = model.forward

    def scaled(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = scaled
    try:
        loss_fn = make_loss_fn(model, params, batches)
        assert loss_fn.fast is False
        assert torch.allclose(loss_fn(0), plain_loss(model, batches[0]))
    finally:
        del model.forward
