"""Shared-prefix packing (editing/prefixtree.py) is exact: the packed loss and gradients are the padded batch's."""

import pytest
import torch

from crispedit.data.tokenize import collate, encode_pairs, split_context_target
from crispedit.editing.fastpath import _FastLoss, make_loss_fn, plain_loss, prefix_sharing
from crispedit.editing.prefixtree import group_sequences, pack_prefixes, packing_pays
from crispedit.layers import resolve_layers

HEADER = "System: you are a careful assistant who answers in one line.\nUser:"
QUESTIONS = ["Who wrote the book?", "Where is the river located exactly?", "Q?", "Who wrote the book?"]
TARGETS = ["Author Name", "In the north", "A", "Someone Else"]  # the 1st and 4th diverge at the target


def _batch(tok, contexts, targets, keys=None):
    rows = [split_context_target(tok, c, c + " " + t) for c, t in zip(contexts, targets)]
    return collate(tok, rows, keys=keys)


def _shared_batch(tok):
    """A header shared by every sequence, a question shared by some, a duplicate sequence, and a question under
    two lead-ins (so sequences diverge at, before and after their targets)."""
    contexts = [HEADER + " " + q for q in QUESTIONS] + [
        QUESTIONS[0] + "\nReply:",
        QUESTIONS[0] + " ->",
        HEADER + " " + QUESTIONS[2],
    ]
    return _batch(tok, contexts, TARGETS + [TARGETS[0], TARGETS[0], TARGETS[2]])


def _train(model, pattern):
    params = {n: m.weight for n, m in resolve_layers(model, pattern).items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    return params


def _grads(params, loss):
    for p in params.values():
        p.grad = None
    loss.backward()
    return {n: p.grad.clone() for n, p in params.items()}


def test_group_sequences_joins_shared_beginnings():
    seqs = [[1, 2, 3, 4, 5], [9, 9], [1, 2, 3, 4, 6, 7], [1, 2, 3, 8], [1, 2, 3, 4]]
    assert group_sequences(seqs, min_shared=4) == [[0, 2, 4], [1], [3]]
    assert group_sequences(seqs, min_shared=3) == [[0, 2, 3, 4], [1]]
    assert group_sequences(seqs, min_shared=99) == [[0], [1], [2], [3], [4]]


def test_pack_prefixes_layout(tiny_tok):
    b = _shared_batch(tiny_tok)
    p = pack_prefixes(b.input_ids, b.attention_mask, b.labels)
    R, L = p.shape
    lengths = b.attention_mask.sum(1).tolist()
    seqs = [b.input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
    distinct = {tuple(s[: t + 1]) for s in seqs for t in range(len(s))}
    assert p.nodes == len(distinct) < sum(lengths)  # one node per distinct beginning
    # one target term per target token of every sequence, predicting the same token as the padded batch
    shifted = b.labels[:, 1:]
    assert p.rows.numel() == int((shifted != -100).sum())
    assert sorted(p.targets.tolist()) == sorted(shifted[shifted != -100].tolist())
    # every node stands for a position of the batch with its token at its depth, and attends to itself and to one
    # ancestor per earlier position of its sequence; the rest of the layout is padding that attends to itself
    T = b.input_ids.shape[1]
    flat_ids, flat_pos, seen = p.input_ids.reshape(-1), p.position_ids.reshape(-1), p.mask[:, 0].reshape(R * L, L)
    nodes = [
        j
        for j in range(R * L)
        if int(seen[j].sum()) == int(flat_pos[j]) + 1
        and int(flat_ids[j]) == int(b.input_ids.reshape(-1)[p.source[j]])
        and int(flat_pos[j]) == int(p.source[j]) % T
    ]
    assert len(nodes) >= p.nodes and R * L >= p.nodes and bool(p.mask[:, 0].diagonal(dim1=1, dim2=2).all())
    assert set(p.rows.tolist()) <= set(nodes)  # targets are predicted from nodes only
    # ``where`` inverts ``source``: each real position is computed by a node holding its token at its depth, one
    # node per distinct beginning, and padding maps to -1
    real = b.attention_mask.bool()
    assert bool((p.where[~real] == -1).all()) and bool((p.where[real] >= 0).all())
    w = p.where[real]
    assert torch.equal(flat_ids[w], b.input_ids[real]) and torch.equal(flat_pos[w], real.nonzero()[:, 1])
    assert len(set(w.tolist())) == p.nodes and set(w.tolist()) <= set(nodes)
    assert torch.equal(p.where.view(-1)[p.source[w]], w)
    assert packing_pays(tuple(b.input_ids.shape), p, margin=10.0)
    assert not packing_pays(tuple(b.input_ids.shape), p, margin=0.0)


def test_large_groups_split_into_trees_of_bounded_size(tiny_tok, tiny_lm64):
    """A group over ``max_nodes`` becomes several trees (the shared beginning computed once per tree), each a
    separate row of at most ``max_nodes`` positions, with the same loss."""
    model, tok = tiny_lm64
    b = _batch(tok, [HEADER + " " + q for q in QUESTIONS * 4], TARGETS * 4)
    whole = pack_prefixes(b.input_ids, b.attention_mask, b.labels, max_nodes=None)
    cap = b.input_ids.shape[1] + 2  # the longest sequence fits, not two different ones
    split = pack_prefixes(b.input_ids, b.attention_mask, b.labels, max_nodes=cap)
    assert whole.shape[0] == 1 and split.shape[0] >= 2 and split.shape[1] <= cap
    assert whole.nodes < split.nodes < int(b.attention_mask.sum())
    params = _train(model, "model.layers.0.mlp.down_proj")
    fast = _FastLoss(model, params, [b])
    for p in (whole, split):
        assert torch.allclose(fast.packed_loss(p, None, None), plain_loss(model, b), rtol=1e-10)


@pytest.mark.parametrize("pattern,k", [("model.layers.{2-3}.mlp.down_proj", 2), ("model.layers.0.mlp.down_proj", 0)])
def test_packed_loss_and_gradients_equal_the_padded_batch(tiny_lm64, pattern, k):
    model, tok = tiny_lm64
    params = _train(model, pattern)
    batch = _shared_batch(tok)
    fast = _FastLoss(model, params, [batch])
    assert fast.k == k
    packed = pack_prefixes(batch.input_ids, batch.attention_mask, batch.labels)
    states = fast.cache[0].reshape(-1, fast.cache[0].shape[-1]) if k else None
    lp, lk = plain_loss(model, batch), fast.packed_loss(packed, states, None)
    assert torch.allclose(lp, lk, rtol=1e-10)
    gp, gk = _grads(params, plain_loss(model, batch)), _grads(params, fast.packed_loss(packed, states, None))
    for n in gp:  # float64 rounding of other kernel shapes, amplified by this random model (eager vs sdpa: ~4e-7)
        assert (gp[n] - gk[n]).norm() <= 1e-7 * gp[n].norm()
    assert all(type(b).__name__ == "LlamaDecoderLayer" for b in model.model.layers)  # blocks restored


def test_make_loss_fn_packs_where_it_pays_and_not_when_told_not_to(tiny_lm64):
    model, tok = tiny_lm64
    params = _train(model, "model.layers.{2-3}.mlp.down_proj")
    shared = _batch(tok, [HEADER + " " + q for q in QUESTIONS * 4], TARGETS * 4)  # a long common header
    bare = encode_pairs(tok, QUESTIONS[1:3], TARGETS[1:3])  # nothing to share
    loss_fn = make_loss_fn(model, params, [shared, bare])
    lay = loss_fn.layout()
    assert loss_fn.fast and lay["packed_batches"] == 1 and lay["positions_per_epoch"] < lay["padded_per_epoch"]
    for i, b in enumerate([shared, bare]):
        assert torch.allclose(loss_fn(i), plain_loss(model, b), rtol=1e-10)
    with prefix_sharing(False):
        off = make_loss_fn(model, params, [shared, bare])
    assert off.fast and off.layout()["packed_batches"] == 0
    assert off.layout()["positions_per_epoch"] == off.layout()["padded_per_epoch"]


def test_prepared_batches_are_packed_and_exact(tiny_lm64):
    """An epoch's batch made anew (``--context-sample``) is packed too, its cached states gathered per node."""
    model, tok = tiny_lm64
    params = _train(model, "model.layers.{2-3}.mlp.down_proj")
    contexts = [HEADER + " " + q for q in QUESTIONS * 4]
    full = _batch(tok, contexts, TARGETS * 4, keys=list(range(16)))
    loss_fn = make_loss_fn(model, params, [full])
    sub = _batch(tok, contexts[3:12], (TARGETS * 4)[3:12], keys=list(range(3, 12)))
    prepared = loss_fn.prepare(sub)
    assert prepared.packed is not None
    assert torch.allclose(loss_fn(prepared), plain_loss(model, sub), rtol=1e-10)


def test_no_packing_with_dropout_or_without_full_masks(tiny_tok):
    from conftest import build_llama

    shared = lambda tok: _batch(tok, [HEADER + " " + q for q in QUESTIONS * 4], TARGETS * 4)  # noqa: E731
    model = build_llama(len(tiny_tok), dtype=torch.float64)
    model.config.attention_dropout = 0.1  # one dropout mask per shared position would not be exact
    params = _train(model, "model.layers.{2-3}.mlp.down_proj")
    assert make_loss_fn(model, params, [shared(tiny_tok)]).layout()["packed_batches"] == 0
    model.config.attention_dropout = 0.0
    assert make_loss_fn(model, params, [shared(tiny_tok)]).layout()["packed_batches"] == 1
    model.config._attn_implementation = "eager"  # builds its own masks: a packed mask would not reach it as is
    try:
        loss_fn = make_loss_fn(model, params, [shared(tiny_tok)])
        assert loss_fn.fast and loss_fn.layout()["packed_batches"] == 0
    finally:
        model.config._attn_implementation = "sdpa"


def test_an_edit_trains_the_same_with_and_without_packing(tiny_lm64, iso_cache):
    """Through the whole loop (projection, Adam, skip and stop rules): packed batches give the epoch losses and
    the edited weights of padded ones, and the report says how many positions an epoch computed."""
    from crispedit.data import EditRequest
    from crispedit.editing import EditConfig, edit, restore

    model, tok = tiny_lm64
    reqs = [EditRequest(f"Who wrote the famous book number {i}?", f"Author {chr(65 + i)}") for i in range(4)]
    cfg = EditConfig(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=4,
        lr=1e-2,
        batch_size=6,
        n_cap=4,
        max_len=48,
        contexts="bare,lead:3",
        stop_loss=0.0,
    )
    packed = edit(model, tok, reqs, cfg, progress=False)
    w_packed = {n: model.get_parameter(n).detach().clone() for n in packed.original_weights}
    restore(model, packed.original_weights)
    with prefix_sharing(False):
        padded = edit(model, tok, reqs, cfg, progress=False)
    extra_p, extra_n = packed.history.extra, padded.history.extra
    assert extra_p["packed_batches"] > 0 and extra_n["packed_batches"] == 0
    assert extra_p["positions_per_epoch"] < extra_n["positions_per_epoch"] == extra_n["padded_per_epoch"]
    assert packed.history.epoch_loss == pytest.approx(padded.history.epoch_loss, rel=1e-6)
    assert packed.history.epoch_loss[-1] < packed.history.epoch_loss[0]
    for n, w in w_packed.items():
        assert (model.get_parameter(n) - w).norm() <= 1e-6 * (w - packed.original_weights[n]).norm()
