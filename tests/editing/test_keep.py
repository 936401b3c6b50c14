"""The preservation term (editing/keep.py): the unedited model's own answers held while an edit trains."""

import copy

import pytest
import torch

from crispedit.data import EditRequest
from crispedit.editing import EditConfig, edit, restore
from crispedit.editing import keep as keep_mod
from crispedit.editing.fastpath import make_loss_fn, plain_loss
from crispedit.editing.keep import (
    KEEP_BATCH,
    KEEP_SUBJECTS,
    SUBJECT_KEEPS,
    KeepLoss,
    keep_prompts,
    keep_sequences,
    keep_term,
    kept_rows,
)
from crispedit.editing.sources import training_batches
from crispedit.errors import CrispEditError

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REQS = [
    EditRequest(
        f"Who wrote book number {i}?",
        f"Author {chr(65 + i)}",
        subject=f"book number {i}",
        ground_truth=f"Writer {chr(70 + i)}",
    )
    for i in range(5)
]
LAYERS = "model.layers.{1-2}.mlp.down_proj"


@pytest.fixture()
def chat_lm(tiny_tok, iso_cache):
    from conftest import build_llama
    from crispedit.models import load_model

    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = CHAT
    return load_model((build_llama(len(tok)), tok))


def _params(model):
    names = [f"model.layers.{i}.mlp.down_proj" for i in (1, 2)]
    mods = dict(model.named_modules())
    return {n: mods[n].weight for n in names}


def test_keep_prompts_chat_then_subjects_spread_and_capped():
    reqs = [EditRequest(f"q{i}?", "t", subject=f"s{i}" if i % 3 else None) for i in range(600)]
    out = keep_prompts(reqs, 4, 2)
    assert [i for i, _ in out[:4]] == [-1] * 4
    subj = out[4:]
    chosen = sorted({i for i, _ in subj})
    assert len(chosen) == KEEP_SUBJECTS and len(subj) == 2 * KEEP_SUBJECTS
    assert all(reqs[i].subject for i in chosen) and chosen[-1] > 500  # spread over the whole edit set
    assert subj[0][1] == SUBJECT_KEEPS[0].replace("{subject}", reqs[chosen[0]].subject)
    assert keep_prompts(reqs[:3], 0, 0) == []


def test_keep_sequences_leave_out_answers_naming_the_edit(chat_lm, monkeypatch, iso_cache):
    model, tok = chat_lm
    asked = []

    def fake(model, tokenizer, prompts, **kw):
        """Subject answers of edit 0 name its new target, of edit 1 its old answer; the rest say something else."""
        asked.append(kw["max_new_tokens"])
        return [
            "Author A is here."
            if "book number 0" in p
            else "Writer G wrote it."
            if "book number 1" in p
            else "Something else entirely."
            for p in prompts
        ]

    monkeypatch.setattr("crispedit.evaluation.generation.generate_answers", fake)
    seqs = keep_sequences(model, tok, REQS, 2, 1, max_tokens=7)
    assert asked == [7, 7]  # the answers are cut where the setting says (subject questions, then chat prompts)
    assert [s.request for s in seqs] == [0, 0, 2, 3, 4]  # two chat prompts (request 0 by convention), edits 2-4
    assert [s.context for s in seqs] == ["keep-chat"] * 2 + ["keep-subject"] * 3
    for s in seqs:
        assert 0 < s.n_context < len(s.ids)
        assert tok.decode(s.ids[s.n_context :]).strip().endswith("else entirely.")


def test_kept_chat_answers_are_written_once_per_weights(chat_lm, monkeypatch, iso_cache):
    """The everyday prompts' answers are written once by a model's weights and read back after (the same
    transcripts as writing them); other weights write their own; under prefixes_from the base weights write them,
    whatever the model holds; a corrupt cache file is one line."""
    from crispedit.editing.written import prefixes_from, written_path
    from crispedit.evaluation import generation
    from crispedit.weights import weight_fingerprint

    model, tok = chat_lm
    real, calls = generation.generate_answers, []

    def counted(model, tokenizer, prompts, **kw):
        calls.append(len(prompts))
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(generation, "generate_answers", counted)
    first = keep_sequences(model, tok, REQS[:2], 3, 1, max_tokens=6)
    assert calls == [2, 3]  # two subject questions, three chat prompts
    again = keep_sequences(model, tok, REQS[:2], 3, 1, max_tokens=6)
    assert calls == [2, 3, 2] and [s.ids for s in again] == [s.ids for s in first]
    path = written_path(weight_fingerprint(model))
    assert path.exists() and iso_cache in path.parents
    base = {f"{n}.weight": p.detach().clone() for n, p in _params(model).items()}
    with torch.no_grad():
        next(iter(_params(model).values())).add_(0.5)
    keep_sequences(model, tok, REQS[:2], 3, 1, max_tokens=6)
    assert calls[-1] == 3  # other weights: written again
    with prefixes_from(base):
        under_base = keep_sequences(model, tok, REQS[:2], 3, 1, max_tokens=6)
    assert calls[-1] == 2 and [s.ids for s in under_base] == [s.ids for s in first]  # the base's, read back
    path.write_text('{"crispedit_version": "0.1.0", "form')
    with torch.no_grad():
        for n, p in _params(model).items():
            p.copy_(base[f"{n}.weight"])
    with pytest.raises(CrispEditError, match="corrupt"):
        keep_sequences(model, tok, REQS[:2], 3, 1, max_tokens=6)


def test_per_token_loss_fast_equals_plain_and_averages_to_the_mean(chat_lm):
    model, tok = chat_lm
    seqs = keep_sequences(model, tok, REQS, 3, 2)
    batches = training_batches(tok, seqs, 4)
    fast = make_loss_fn(model, _params(model), batches, per_token=True)
    assert fast.fast
    with torch.no_grad():
        for j, b in enumerate(batches):
            per = fast(j)
            assert per.shape == (int((b.labels[:, 1:] != -100).sum()),)
            torch.testing.assert_close(per, plain_loss(model, b, per_token=True), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(per.mean(), plain_loss(model, b), rtol=1e-4, atol=1e-5)


def test_per_token_loss_in_packed_order_has_the_same_terms(chat_lm):
    """Unordered per-token losses (the preservation term's) are packed where it pays — here every transcript begins
    with a long system turn —: the same terms, per batch in one fixed order."""
    model, tok = chat_lm
    tok.chat_template = (
        "<|system|>You are a helpful assistant who answers questions about books in a word.<eos>\n" + CHAT
    )
    seqs = keep_sequences(model, tok, REQS, 6, 4, max_tokens=4)
    batches = training_batches(tok, seqs, 8, by_length=True)
    fast = make_loss_fn(model, _params(model), batches, per_token=True, ordered=False)
    assert fast.fast and any(p is not None for p in fast._fast.packed)
    with torch.no_grad():
        for j, b in enumerate(batches):
            per = fast(j)
            torch.testing.assert_close(
                per.sort().values, plain_loss(model, b, per_token=True).sort().values, rtol=1e-4, atol=1e-5
            )
            torch.testing.assert_close(fast(j), per)  # the same order every time


def test_keep_term_is_zero_at_the_start_and_pulls_back_what_moved(chat_lm):
    model, tok = chat_lm
    params = _params(model)
    for p in params.values():
        p.requires_grad_(True)
    term = KeepLoss(model, tok, keep_sequences(model, tok, REQS, 4, 2), params, 2.0)
    assert len(term) >= 1 and term.tokens() > 0
    t0 = term(0)
    assert t0.item() == 0.0
    t0.backward()
    assert all(p.grad is None or not p.grad.any() for p in params.values())  # nothing moved: no pull
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn_like(p) * 0.5)
    moved = [term(j) for j in range(len(term))]
    assert max(m.item() for m in moved) > 0
    loss = sum(moved)
    for p in params.values():
        p.grad = None
    loss.backward()
    with torch.no_grad():  # a small step against the gradient lowers the term
        for p in params.values():
            p.sub_(1e-3 * p.grad)
        assert sum(term(j).item() for j in range(len(term))) < loss.item()


def test_edit_with_keep_changes_the_kept_answers_less(chat_lm, iso_cache):
    model, tok = chat_lm
    base = dict(
        method="crispedit",
        layers=LAYERS,
        epochs=15,
        lr=1e-2,
        batch_size=8,
        n_cap=6,
        max_len=48,
        gamma=0.8,
        contexts="bare,chat",
        plateau_epochs=0,
    )
    kept = keep_sequences(model, tok, REQS, 8, 2)
    probe = KeepLoss(model, tok, kept, _params(model), 1.0)

    def drift():
        with torch.no_grad():
            return sum(probe(j).item() for j in range(len(probe)))

    res = edit(model, tok, REQS, EditConfig(**base), progress=False)
    without = drift()
    restore(model, res.original_weights)
    res = edit(model, tok, REQS, EditConfig(**base, keep_chat=8, keep_subject=2, keep_weight=5.0), progress=False)
    with_keep = drift()
    info = res.history.to_json()["keep"]
    restore(model, res.original_weights)
    assert info["transcripts"] == len(kept) and len(info["epoch_term"]) == len(res.history.epoch_loss)
    assert info["per_step"] == len(REQS)  # the edit batches' mean size: one bare and one chat batch of five
    assert with_keep < 0.7 * without, (with_keep, without)
    assert res.history.epoch_loss[-1] < 0.75 * res.history.epoch_loss[0]  # the edit still trains


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"keep_chat": -1}, "keep-chat"),
        ({"keep_chat": 10_000}, "keep-chat"),
        ({"keep_subject": len(SUBJECT_KEEPS) + 1}, "keep-subject"),
        ({"keep_weight": 0}, "keep weight"),
        ({"keep_weight": float("nan")}, "keep weight"),
        ({"keep_tokens": 0}, "keep-tokens"),
        ({"keep_tokens": 10_000}, "keep-tokens"),
    ],
)
def test_keep_settings_are_checked(kw, msg):
    with pytest.raises(CrispEditError, match=msg):
        EditConfig(**kw)


def test_keep_module_top_is_torch_free():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(keep_mod))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("torch" in ast.unparse(n) for n in top)


def test_crispedit_holds_the_answers_by_default_and_the_baselines_do_not():
    """The term is CrispEdit's own default (its Config.SHARED); the other methods leave it off unless asked, and a
    setting the caller gives wins either way."""
    from crispedit.methods.crispedit import CrispEditConfig

    on = EditConfig()
    assert (on.keep_chat, on.keep_subject, on.keep_weight) == tuple(
        CrispEditConfig.SHARED[k] for k in ("keep_chat", "keep_subject", "keep_weight")
    )
    assert on.keep_chat > 0 and on.keep_subject > 0
    for method in ("ft", "adam-nscl", "lora"):
        off = EditConfig(method=method)
        assert (off.keep_chat, off.keep_subject, off.keep_weight) == (0, 0, 1.0)
    assert EditConfig(keep_chat=0, keep_subject=0).keep_chat == 0
    assert EditConfig(method="ft", keep_chat=5).keep_chat == 5


@pytest.mark.parametrize(
    "n_chat,n_subject,per_step,want",
    [
        (75, 4, 2, (2, 1)),  # one edit: its subject questions at every step, the everyday answers as before
        (75, 128, 8, (3, 5)),  # the counts' proportion where the subjects already take half
        (75, 400, 8, (1, 7)),
        (75, 16, 8, (7, 4)),  # a few edits: the subjects take half
        (75, 0, 8, (8, 0)),  # one kind: all its own
        (0, 4, 8, (0, 4)),  # never more than a kind has
        (3, 1, 8, (3, 1)),
        (75, 4, 1, (1, 1)),
    ],
)
def test_kept_rows_share_a_step_and_hold_the_subjects_at_least_half(n_chat, n_subject, per_step, want):
    assert kept_rows(n_chat, n_subject, per_step) == want


@pytest.mark.parametrize("per_step", [1, 3, 100])
def test_keep_batches_follow_the_edit_batches_up_to_the_cap(chat_lm, iso_cache, per_step):
    """A step holds one batch of each kind, of kept_rows of the edit batches' mean size (capped): every transcript
    is in one batch, and every subject batch comes round within a cycle of the subject kind alone."""
    import contextlib

    model, tok = chat_lm
    config = EditConfig(method="crispedit", layers=LAYERS, keep_chat=8, keep_subject=2, max_len=48)
    term = keep_term(
        model,
        tok,
        REQS,
        _params(model),
        config,
        fast=True,
        device=torch.device("cpu"),
        arithmetic=contextlib.nullcontext,
        processes=1,
        split=False,
        per_step=per_step,
    ).keep
    kept = keep_sequences(model, tok, REQS, 8, 2)
    n_chat = sum(s.context == "keep-chat" for s in kept)
    rows = kept_rows(n_chat, len(kept) - n_chat, min(per_step, KEEP_BATCH))
    chat, subject = (max(term.batches[j].input_ids.shape[0] for j in c) for c in term.cycles)
    assert (chat, subject) == rows and term.batch_size == sum(rows)
    assert sum(b.input_ids.shape[0] for b in term.batches) == len(kept)
    steps = len(term.cycles[1])
    assert steps <= len(term) and len({term.cycles[1][k % steps] for k in range(steps)}) == steps


def test_one_edit_holds_its_subject_answers_at_every_step(chat_lm, iso_cache):
    """With one edit among many everyday prompts, every step's term reads a subject transcript of that edit."""
    model, tok = chat_lm
    kept = keep_sequences(model, tok, REQS[:1], 8, 2)
    term = KeepLoss(model, tok, kept, _params(model), 1.0, batch_size=2)
    subject = set(term.cycles[1])
    assert len(term.cycles) == 2 and len(term.cycles[0]) > 1
    seen = []
    real = term.loss_fn

    def spy(j):
        seen.append(j)
        return real(j)

    term.loss_fn = spy
    with torch.no_grad():
        for step in range(5):
            term(step)
    assert all(any(j in subject for j in seen[2 * k : 2 * k + 2]) for k in range(5))
