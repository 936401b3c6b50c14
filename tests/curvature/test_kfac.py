"""K-FAC collection against an independent brute-force computation (float64, per sequence, per token)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crispedit.curvature.factors import KFACFactors
from crispedit.curvature.kfac import collect_lm_kfac
from crispedit.curvature.lm_backward import sample_labels
from crispedit.curvature.statistics import FactorAccumulator, layer_rows
from crispedit.data import capability_corpus
from crispedit.layers import resolve_layers

TEXTS = [t[:300] for t in capability_corpus(None, 5)] + ["Short one.", "Another, slightly longer, text here."]


def brute_force_kfac(model, tok, texts, layer_names, label_mode, seed, max_len=64, loss_from=None):
    """One sequence at a time, no padding; g from additive zero probes (parameter-style autograd),
    accumulated token by token in Python (with ``loss_from``, text ``i``'s positions predicting tokens before
    ``loss_from[i]`` left out)."""
    modules = dict(model.named_modules())
    A = {n: 0.0 for n in layer_names}
    S = {n: 0.0 for n in layer_names}
    count = 0
    for i, text in enumerate(texts):
        ids = tok(text, truncation=True, max_length=max_len, return_tensors="pt")["input_ids"]
        T = ids.shape[1]
        if T < 2:
            continue
        inputs, probes, handles = {}, {}, []
        for n in layer_names:
            d_out = modules[n].out_features
            probes[n] = torch.zeros(1, T, d_out, dtype=torch.float64, requires_grad=True)

            def hook(mod, args, out, n=n, inputs=inputs, probes=probes):
                inputs[n] = args[0].detach()
                return out + probes[n]

            handles.append(modules[n].register_forward_hook(hook))
        for p in model.parameters():
            p.requires_grad_(False)
        logits = model(input_ids=ids).logits[0, :-1]
        for h in handles:
            h.remove()
        labels = ids[0, 1:] if label_mode == "empirical" else sample_labels(logits, seed, i)
        loss = F.cross_entropy(logits, labels, reduction="sum")
        grads = torch.autograd.grad(loss, [probes[n] for n in layer_names])
        first = 0 if loss_from is None else max(loss_from[i] - 1, 0)
        for n, g in zip(layer_names, grads):
            for t in range(first, T - 1):
                a_t, g_t = inputs[n][0, t], g[0, t]
                A[n] = A[n] + torch.outer(a_t, a_t)
                S[n] = S[n] + torch.outer(g_t, g_t)
        count += max(T - 1 - first, 0)
    return {n: A[n] / count for n in layer_names}, {n: S[n] / count for n in layer_names}, count


@pytest.mark.parametrize("label_mode", ["empirical", "sampled"])
def test_kfac_matches_brute_force(tiny_lm64, label_mode):
    model, tok = tiny_lm64
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj,model.layers.3.self_attn.o_proj")
    f = collect_lm_kfac(
        model,
        tok,
        TEXTS,
        layers,
        max_len=64,
        batch_size=3,
        label_mode=label_mode,
        seed=7,
        stat_dtype=torch.float64,
        progress=False,
    )
    A, S, n = brute_force_kfac(model, tok, TEXTS, list(layers), label_mode, seed=7)
    assert f.n_tokens == n
    for name in layers:
        assert torch.allclose(f.A[name].double(), A[name], rtol=1e-5, atol=1e-8), name
        assert torch.allclose(f.S[name].double(), S[name], rtol=1e-4, atol=1e-9), name
    assert f.meta["label_mode"] == label_mode


def test_loss_from_keeps_only_the_target_rows(tiny_lm64):
    """Token-id input with ``loss_from`` (a prompt left out, as CrispEdit-Seq's target-only edit factors): the
    factors average exactly the positions that predict tokens from ``loss_from[i]`` on; ``loss_from`` all zero
    and token ids give the text path's factors."""
    model, tok = tiny_lm64
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    ids = tok(TEXTS, truncation=True, max_length=64)["input_ids"]
    start = [min(5 + i, len(x) - 1) for i, x in enumerate(ids)]
    kw = dict(max_len=64, batch_size=3, label_mode="empirical", stat_dtype=torch.float64, progress=False)
    f = collect_lm_kfac(model, tok, ids, layers, loss_from=start, **kw)
    A, S, n = brute_force_kfac(model, tok, TEXTS, list(layers), "empirical", seed=0, loss_from=start)
    assert f.n_tokens == n == sum(len(x) - max(s, 1) for x, s in zip(ids, start))
    for name in layers:
        assert torch.allclose(f.A[name].double(), A[name], rtol=1e-5, atol=1e-8), name
        assert torch.allclose(f.S[name].double(), S[name], rtol=1e-4, atol=1e-9), name
    whole = collect_lm_kfac(model, tok, TEXTS, layers, **kw)
    zero = collect_lm_kfac(model, tok, ids, layers, loss_from=[0] * len(ids), **kw)
    assert zero.n_tokens == whole.n_tokens
    for name in layers:
        assert torch.allclose(zero.A[name], whole.A[name]) and torch.allclose(zero.S[name], whole.S[name])
    with pytest.raises(ValueError, match="loss_from has 1 entries"):
        collect_lm_kfac(model, tok, ids, layers, loss_from=[0], **kw)


def test_batching_and_padding_do_not_change_factors(tiny_lm64):
    model, tok = tiny_lm64
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    f1 = collect_lm_kfac(model, tok, TEXTS, layers, max_len=64, batch_size=1, stat_dtype=torch.float64, progress=False)
    # pad with a token id that also occurs in the text: masking must come from the attention mask
    real_id = tok(TEXTS[0])["input_ids"][3]
    old_pad = tok.pad_token
    tok.pad_token = tok.convert_ids_to_tokens(real_id)
    try:
        f4 = collect_lm_kfac(
            model, tok, TEXTS, layers, max_len=64, batch_size=4, stat_dtype=torch.float64, progress=False
        )
    finally:
        tok.pad_token = old_pad
    for name in layers:
        assert torch.allclose(f1.A[name], f4.A[name], rtol=1e-6, atol=1e-10)
        assert torch.allclose(f1.S[name], f4.S[name], rtol=1e-6, atol=1e-10)


def test_sampled_and_empirical_differ_and_seed_matters(tiny_lm):
    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.2.mlp.down_proj")
    name = next(iter(layers))
    kw = dict(max_len=48, batch_size=4, progress=False)
    fe = collect_lm_kfac(model, tok, TEXTS, layers, label_mode="empirical", **kw)
    fs0 = collect_lm_kfac(model, tok, TEXTS, layers, label_mode="sampled", seed=0, **kw)
    fs0b = collect_lm_kfac(model, tok, TEXTS, layers, label_mode="sampled", seed=0, **kw)
    fs1 = collect_lm_kfac(model, tok, TEXTS, layers, label_mode="sampled", seed=1, **kw)
    assert torch.allclose(fe.A[name], fs0.A[name])  # A does not depend on labels
    assert not torch.allclose(fe.S[name], fs0.S[name])
    assert torch.equal(fs0.S[name], fs0b.S[name])  # reproducible
    assert not torch.equal(fs0.S[name], fs1.S[name])


def test_collection_freezes_and_restores_parameters(tiny_lm):
    model, tok = tiny_lm
    for p in model.parameters():
        p.requires_grad_(True)
    layers = resolve_layers(model, "model.layers.3.mlp.down_proj")
    collect_lm_kfac(model, tok, TEXTS[:2], layers, max_len=32, progress=False)
    assert all(p.grad is None for p in model.parameters())  # backward computed no parameter gradients
    assert all(p.requires_grad for p in model.parameters())


def test_sample_labels_follow_the_predictive_distribution():
    logits = torch.tensor([[2.0, 0.0, -1.0]]).repeat(20000, 1)
    labels = sample_labels(logits, seed=3, index=0)
    freq = torch.bincount(labels, minlength=3).double() / labels.numel()
    assert torch.allclose(freq, torch.softmax(logits[0].double(), 0), atol=0.015)
    assert torch.equal(labels, sample_labels(logits, seed=3, index=0))
    # a peaked, wide distribution: impossible labels never come, the frequencies still follow
    wide = torch.full((30000, 1000), float("-inf"))
    wide[:, [0, 7, 999]] = torch.tensor([0.0, 1.0, 3.0])
    got = sample_labels(wide, seed=1, index=5)
    assert set(got.unique().tolist()) <= {0, 7, 999}
    freq = torch.bincount(got, minlength=1000)[[0, 7, 999]].double() / got.numel()
    assert torch.allclose(freq, torch.softmax(torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64), 0), atol=0.012)
    assert not torch.equal(got, sample_labels(wide, seed=1, index=6))  # another sequence, another draw


def test_conv2d_rows_reproduce_the_convolution():
    conv = nn.Conv2d(3, 5, kernel_size=3, padding=1, stride=2, bias=False).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    rows = layer_rows(conv, x)  # B x L x (C_in k k)
    out = rows @ conv.weight.reshape(5, -1).T  # B x L x C_out
    ref = conv(x).flatten(2).transpose(1, 2)
    assert torch.allclose(out, ref)


def test_accumulator_and_merge():
    acc = FactorAccumulator(torch.float64)
    a, g = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    acc.add("l", a[:4], g[:4])
    acc.add("l", a[4:], g[4:])
    f = acc.factors(["l"], out_dtype=torch.float64)
    assert torch.allclose(f.A["l"], a.T @ a / 10) and torch.allclose(f.S["l"], g.T @ g / 10)
    f1 = KFACFactors({"l": a[:4].T @ a[:4] / 4}, {"l": g[:4].T @ g[:4] / 4}, 4)
    f2 = KFACFactors({"l": a[4:].T @ a[4:] / 6}, {"l": g[4:].T @ g[4:] / 6}, 6)
    m = f1.merged(f2)  # token-weighted merge equals one-shot over the union
    assert torch.allclose(m.A["l"], f.A["l"]) and torch.allclose(m.S["l"], f.S["l"]) and m.n_tokens == 10
    mix = f1.merged(f2, weight=0.25)
    assert torch.allclose(mix.A["l"], 0.75 * f1.A["l"] + 0.25 * f2.A["l"])


def legacy_collect_lm_kfac(model, tok, texts, layers, *, max_len, batch_size, label_mode, seed):
    """The collection loop as it was before batches were planned by length and the LM head ran on loss
    positions only: corpus-order chunks padded by the tokenizer, full ``B x T x V`` logits, fp32 products
    added to float64 sums."""
    from crispedit.curvature.lm_batches import loss_positions
    from crispedit.curvature.statistics import capture_io, frozen

    acc = FactorAccumulator(torch.float32)
    tok.padding_side = "right"
    with frozen(model):
        for b in range(0, len(texts), batch_size):
            chunk = list(texts[b : b + batch_size])
            enc = tok(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
            ids, attn = enc["input_ids"], enc["attention_mask"]
            pos = loss_positions(attn)
            with capture_io(layers) as store:
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                if label_mode == "empirical":
                    labels = ids[:, 1:]
                else:
                    labels = torch.stack([sample_labels(logits[i], seed, b + i) for i in range(len(chunk))])
                F.cross_entropy(logits[pos], labels[pos], reduction="sum").backward()
            for name in layers:
                acc.add(name, store[name].inputs[0][:, :-1][pos], store[name].grads[0][:, :-1][pos])
    return acc.factors(list(layers))


def _rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("label_mode", ["empirical", "sampled"])
@pytest.mark.parametrize("max_padding", [None, 0.0, 0.25])
def test_fast_collection_matches_the_legacy_loop_in_float32(tiny_lm, label_mode, max_padding):
    """Length-planned batches + LM head on loss positions only give the old loop's factors to fp32 round-off."""
    model, tok = tiny_lm
    texts = [t[:400] for t in capability_corpus(None, 9)] + ["Short one.", "x", ""]
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj,model.layers.3.self_attn.o_proj")
    old = legacy_collect_lm_kfac(model, tok, texts, layers, max_len=48, batch_size=4, label_mode=label_mode, seed=5)
    new = collect_lm_kfac(
        model,
        tok,
        texts,
        layers,
        max_len=48,
        batch_size=4,
        label_mode=label_mode,
        seed=5,
        max_padding=max_padding,
        progress=False,
    )
    assert new.n_tokens == old.n_tokens
    for name in layers:
        assert _rel(new.A[name], old.A[name]) < 1e-6, name
        assert _rel(new.S[name], old.S[name]) < 1e-6, name


def test_plan_batches_groups_by_length_and_bounds_padding():
    from crispedit.curvature.lm_batches import plan_batches

    lengths = [5, 30, 1, 31, 8, 29, 6, 0, 7, 30]
    assert plan_batches(lengths, 3, None) == [[0, 1, 3], [4, 5, 6], [8, 9]]  # corpus order, no 0/1-token texts
    plan = plan_batches(lengths, 3, 0.25)
    assert sorted(i for b in plan for i in b) == [0, 1, 3, 4, 5, 6, 8, 9]
    assert plan[0] == [3, 1, 9] and plan[1][0] == 5  # longest first, ties in corpus order
    for b in plan:
        assert len(b) <= 3
        longest = max(lengths[i] for i in b)
        assert 1 - sum(lengths[i] for i in b) / (len(b) * longest) <= 0.25
    assert plan == [[3, 1, 9], [5], [4, 8, 6], [0]]
    assert all(len({lengths[i] for i in b}) == 1 for b in plan_batches(lengths, 4, 0.0))
    with pytest.raises(ValueError):
        plan_batches(lengths, 0)
    with pytest.raises(ValueError):
        plan_batches(lengths, 2, 1.0)


def test_head_runs_on_loss_positions_only(tiny_lm):
    """The LM head sees exactly the N loss positions of a padded batch (not B x T)."""
    from crispedit.curvature.lm_backward import lm_row_logits
    from crispedit.curvature.lm_batches import lm_batches

    model, tok = tiny_lm
    seen = []
    h = model.lm_head.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    try:
        (batch,) = lm_batches(
            tok, ["A somewhat longer text than the other.", "Short."], max_len=32, batch_size=2, max_padding=None
        )
        logits = lm_row_logits(model, batch)
    finally:
        h.remove()
    ref = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[batch.rows]
    assert seen == [(1, batch.n_rows, model.config.hidden_size)]
    assert batch.n_rows == int(batch.attention_mask.sum()) - 2
    assert torch.allclose(logits, ref, atol=1e-5)


def test_plain_head_is_detected_and_post_processed_heads_fall_back(tiny_lm):
    """A llama head is used directly (hidden-state gradient formed without logits); a head whose output the
    model changes (here a forward hook doubling the logits, like soft-capping) is not, and the collection
    then goes through the model's own logits and still matches the old loop."""
    from crispedit.curvature.lm_backward import plain_head
    from crispedit.curvature.lm_batches import lm_batches

    model, tok = tiny_lm
    (batch,) = lm_batches(tok, ["Some text to probe the head with."], max_len=32, batch_size=1)
    assert plain_head(model, batch) is model.lm_head
    assert plain_head(model, batch, skip=[model.lm_head]) is None
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    h = model.lm_head.register_forward_hook(lambda m, a, o: 2.0 * o)
    try:
        assert plain_head(model, batch) is None
        old = legacy_collect_lm_kfac(model, tok, TEXTS, layers, max_len=48, batch_size=3, label_mode="sampled", seed=1)
        new = collect_lm_kfac(
            model, tok, TEXTS, layers, max_len=48, batch_size=3, label_mode="sampled", seed=1, progress=False
        )
    finally:
        h.remove()
    plain = collect_lm_kfac(
        model, tok, TEXTS, layers, max_len=48, batch_size=3, label_mode="sampled", seed=1, progress=False
    )
    for name in layers:
        assert _rel(new.S[name], old.S[name]) < 1e-6 and _rel(new.A[name], old.A[name]) < 1e-6
        assert _rel(plain.S[name], new.S[name]) > 1e-3  # doubling the logits changes the curvature


@pytest.mark.parametrize("label_mode", ["empirical", "sampled"])
def test_hidden_state_gradient_equals_autograd_cross_entropy(tiny_lm, label_mode):
    """(softmax(z) - onehot(y)) W, formed a few sequences at a time, is autograd's gradient of the summed
    cross-entropy of the head's logits, whatever the chunk size."""
    from crispedit.curvature.lm_backward import LabelMode, _ce_grad_rows, lm_labels
    from crispedit.curvature.lm_batches import lm_batches

    model, tok = tiny_lm
    (batch,) = lm_batches(tok, TEXTS[:4], max_len=24, batch_size=4, max_padding=None)
    mode = LabelMode(label_mode)
    h = torch.randn(batch.n_rows, model.config.hidden_size, requires_grad=True)
    logits = model.lm_head(h)
    F.cross_entropy(logits, lm_labels(logits, batch, mode, 3), reduction="sum").backward()
    for chunk in (1, 30, 10_000):
        g = _ce_grad_rows(h.detach(), model.lm_head, batch, mode, 3, chunk_rows=chunk)
        assert torch.allclose(g, h.grad, rtol=1e-5, atol=1e-6), chunk


@pytest.mark.parametrize("d", [3, 256, 300, 600])
def test_add_gram_matches_the_full_product(d):
    from crispedit.curvature.statistics import add_gram_

    x = torch.randn(50, d)
    m = torch.randn(d, d, dtype=torch.float64)
    acc = m + m.T
    ref = acc + (x.double().T @ x.double())
    add_gram_(acc, x, panel=256)
    assert torch.allclose(acc, ref, rtol=1e-5, atol=1e-4)
    if d > 256:  # off-diagonal blocks are mirrored, not recomputed: a symmetric sum stays exactly symmetric
        assert torch.equal(acc[256:, :256], acc[:256, 256:].T)
