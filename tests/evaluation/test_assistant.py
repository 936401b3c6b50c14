"""The chat measures of an edit: style drift on unrelated prompts and subject bleed (evaluation/assistant.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from crispedit.data.edits import EditRequest
from crispedit.evaluation import assistant
from crispedit.evaluation.assistant import (
    BARE_WORDS,
    SUBJECT_PROBES,
    assistant_measures,
    style_drift,
    style_prompts,
    subject_bleed,
    subject_probes,
)
from crispedit.evaluation.drift import answer_kl
from crispedit.evaluation.judges import mentions

REQS = [
    EditRequest("Which river system contains Charity Creek?", "Chichester River", subject="Charity Creek"),
    EditRequest("Who wrote the song?", "Paul Simon"),  # no subject: not probed
    EditRequest("What is the capital of Australia?", "Melbourne", subject="Australia"),
]
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _perturbed(model):
    """A copy of ``model`` with one MLP matrix changed, and the pre-change weights of that matrix."""
    edited = copy.deepcopy(model)
    name = "model.layers.1.mlp.down_proj.weight"
    w = dict(edited.named_parameters())[name]
    base = {name: w.detach().clone()}
    with torch.no_grad():
        w.add_(0.5 * torch.randn_like(w, generator=torch.Generator().manual_seed(1)))
    return edited, base


def test_bundled_style_prompts_are_disjoint_from_the_capability_chat_prompts():
    import json

    from crispedit.data.corpus import bundled_path

    style = style_prompts(None)
    cap = json.loads(bundled_path("chat_prompts.json").read_text())["prompts"]
    assert len(style) >= assistant.STYLE_PROMPTS and len(set(style)) == len(style)
    assert not set(style) & set(cap)


def test_mentions_is_the_rule_judges_containment():
    assert mentions("It flows into the Chichester river, in NSW.", "Chichester River")
    assert mentions("It is the Parramatta River.", "The Chichester River") is False
    assert mentions("Malia and Sasha Obama", "Sasha Obama and Malia Obama")
    assert not mentions("", "Paris") and not mentions("Paris", "")


def test_subject_probes_ask_about_subjects_only_and_respect_the_limit():
    probes = subject_probes(REQS)
    assert [i for i, _ in probes] == [0] * len(SUBJECT_PROBES) + [2] * len(SUBJECT_PROBES)
    assert all("Charity Creek" in q for i, q in probes if i == 0)
    assert subject_probes(REQS, limit=1) == probes[: len(SUBJECT_PROBES)]
    assert subject_probes([REQS[1]]) == []


@pytest.mark.parametrize("chat", [False, True])
def test_an_unchanged_model_has_no_style_drift_and_no_bleed(tiny_lm, chat):
    model, tok = tiny_lm
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT if chat else None
    name = "model.layers.1.mlp.down_proj.weight"
    same = {name: dict(model.named_parameters())[name].detach().clone()}
    out = assistant_measures(model, tok, REQS, same, progress=False)
    st, bl = out["style"], out["bleed"]
    assert st["n"] == assistant.STYLE_PROMPTS and st["length_ratio"] == 1.0 and st["bare_share"] == 0.0
    assert st["changed"] == 0.0 and st["answer_kl"] == pytest.approx(0.0, abs=1e-6) and st["kl_tokens"] > 0
    assert bl["edits"] == 2 and bl["n"] == 2 * len(SUBJECT_PROBES) and bl["target"] == 0.0 and bl["changed"] == 0.0


def test_style_drift_of_a_changed_model_against_weights_equals_against_a_second_model(tiny_lm):
    model, tok = tiny_lm
    edited, base = _perturbed(model)
    prompts = style_prompts(6)
    by_weights = style_drift(edited, tok, base, prompts)
    by_model = style_drift(edited, tok, model, prompts)
    assert by_weights["answer_kl"] > 1e-4 and by_weights["changed"] > 0
    for k in ("length_ratio", "bare_share", "changed", "tokens_base", "tokens_edited"):
        assert by_weights[k] == by_model[k], k
    assert by_weights["answer_kl"] == pytest.approx(by_model["answer_kl"], rel=1e-5)
    # the edited model's weights are back after the base answered
    assert torch.equal(
        dict(edited.named_parameters())[next(iter(base))], dict(edited.named_parameters())[next(iter(base))]
    )


def test_answer_kl_counts_only_the_answer_positions(tiny_lm):
    model, tok = tiny_lm
    edited, base = _perturbed(model)
    seqs = [[5, 9, 12, 40, 41, 42], [7, 8, 30, 31]]
    starts = [3, 2]
    got = answer_kl(edited, seqs, starts, base=base, pad_id=tok.pad_token_id)
    assert got["tokens"] == 3 + 2
    want, n = 0.0, 0
    with torch.no_grad():
        for s, a in zip(seqs, starts):
            ids = torch.tensor([s])
            lp = torch.log_softmax(edited(ids).logits[0, :-1].float(), -1)
            lq = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            for t in range(a - 1, len(s) - 1):
                want += float((lq[t].exp() * (lq[t] - lp[t])).sum())
                n += 1
    assert got["kl"] == pytest.approx(want / n, rel=1e-4)


def test_bleed_counts_answers_that_newly_name_the_target(tiny_lm, monkeypatch):
    """Only an answer that names the edit's target where the base's did not counts as bleed; any other
    difference counts as changed."""
    model, tok = tiny_lm
    k = len(SUBJECT_PROBES)
    base = ["It is a creek."] * k + ["Australia is a country."] * k
    edited = (
        ["Chichester River."]
        + ["It is a creek."] * (k - 1)  # one new mention
        + ["Melbourne, I think."]
        + ["Australia is a big country."]
        + ["Australia is a country."] * (k - 2)
    )
    base[k] = "Its big city is Melbourne."  # the base named it already: not bleed, though changed
    answers = iter([base, edited])
    monkeypatch.setattr(assistant, "_answers", lambda *a, **kw: next(answers))
    out = subject_bleed(model, tok, REQS, {}, progress=False)
    assert out["n"] == 2 * k and out["target"] == pytest.approx(1 / (2 * k), abs=1e-4)
    assert out["changed"] == pytest.approx(3 / (2 * k), abs=1e-4)
    assert out["examples"][0]["edited"] == "Chichester River." and out["examples"][0]["target"] == "Chichester River"
    # per kind of question, over the two subjects: the new mention is a first question's; the first question
    # changed for both subjects, the second for one
    assert [p["question"] for p in out["by_probe"]] == list(SUBJECT_PROBES)
    assert [p["target"] for p in out["by_probe"]] == [0.5] + [0.0] * (k - 1)
    assert [p["changed"] for p in out["by_probe"]] == [1.0, 0.5] + [0.0] * (k - 2)


def test_bare_share_counts_long_base_answers_that_became_bare_phrases(tiny_lm, monkeypatch):
    model, tok = tiny_lm
    long = " ".join(["word"] * (BARE_WORDS + 3))
    base = [long, long, long, "Paris."]
    edited = ["Jane Austen", long, "Twelve.", "Paris."]
    answers = iter([base, edited])
    monkeypatch.setattr(assistant, "_answers", lambda *a, **kw: next(answers))
    monkeypatch.setattr("crispedit.evaluation.drift.answer_kl", lambda *a, **kw: {"kl": 0.5, "tokens": 9})
    out = style_drift(model, tok, {}, ["a?", "b?", "c?", "d?"])
    assert out["bare_share"] == pytest.approx(2 / 3, abs=1e-4)  # the short base answer is not counted
    assert out["changed"] == 0.5 and out["length_ratio"] < 1.0 and out["answer_kl"] == 0.5


def test_evaluate_edit_reports_the_assistant_section_when_asked(tiny_lm):
    from crispedit.evaluation import evaluate_edit

    model, tok = tiny_lm
    edited, base = _perturbed(model)
    out = evaluate_edit(edited, tok, REQS, base, kl_texts=2, assistant=True, progress=False)
    assert set(out["assistant"]) == {"style", "bleed"} and out["assistant"]["style"]["answer_kl"] > 0
    assert "assistant" not in evaluate_edit(edited, tok, REQS, base, kl_texts=2, progress=False)
