import json

import pytest

from conftest import shared_path
from crispedit.data import (
    BUNDLED_EDITS,
    EditRequest,
    bundled_path,
    capability_corpus,
    heldout_text,
    load_edits,
    load_texts,
)
from crispedit.data.tokenize import encode_pairs
from crispedit.errors import CrispEditError


def test_bundled_zsre():
    edits = load_edits(bundled_path(BUNDLED_EDITS))
    assert len(edits) == 64
    e = edits[0]
    assert e.prompt == "Which river system contains Charity Creek?" and e.target == "Chichester River"
    assert e.rephrase_prompts == ["What river system is Charity Creek in?"]
    assert e.locality == [("how many series of diary of a wimpy kid are there?", "12")]


def test_shared_formats():
    cf = load_edits(shared_path("data", "edits", "counterfact_dev.json"), limit=5)
    assert cf[0].prompt == "Reedy Glacier is in" and cf[0].target == "Asia" and cf[0].ground_truth == "Antarctica"
    assert cf[0].locality == [("Mount Erebus, in", "Antarctica")]
    wb = load_edits(shared_path("data", "edits", "wikibigedit_dev.json"), limit=3, offset=1)
    assert len(wb) == 3 and wb[0].rephrase_prompts
    zs = load_edits(shared_path("data", "edits", "zsre_dev.json"), limit=2)
    assert zs[1].target == "Cinematronics"


def test_jsonl_normalised_schema(tmp_path):
    p = tmp_path / "e.jsonl"
    recs = [
        EditRequest("Q1?", "A1", rephrase_prompts=["R1?"], locality=[("L?", "x")]).to_json(),
        {"prompt": "Q2?", "target": "A2"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    edits = load_edits(p)
    assert [e.target for e in edits] == ["A1", "A2"] and edits[0].locality == [("L?", "x")]


@pytest.mark.parametrize(
    "content,msg",
    [
        ("", "empty"),
        ('[{"src": "q", "alt": ', "malformed JSON"),
        ('{"prompt": "q"}\n{oops', "malformed JSON on line 2"),
        ("[]", "no edit records"),
        ('[{"src": "q?", "alt": ""}]', "record 0: field 'alt' is empty"),
        ('[{"prompt": "q?", "target_new": "x"}, {"prompt": "q?"}]', "record 1: unrecognised record"),
        ('[{"src": "q?"}]', "unrecognised"),
        ("[1, 2]", "record 0 is a int"),
        ('[{"prompt": "q?", "target": "   "}]', "'target' is empty"),
    ],
)
def test_bad_edit_files(tmp_path, content, msg):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(CrispEditError, match=msg):
        load_edits(p)


def test_missing_file_and_bad_limit(tmp_path):
    with pytest.raises(CrispEditError, match="not found"):
        load_edits(tmp_path / "nope.json")
    with pytest.raises(CrispEditError, match="positive"):
        load_edits(bundled_path(BUNDLED_EDITS), limit=0)


def test_corpora(tmp_path):
    cap, held = capability_corpus(None, None), heldout_text(None, None)
    assert len(cap) > 500 and len(held) > 100 and not set(cap) & set(held)
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    assert load_texts(p) == ["alpha", "beta"]
    with pytest.raises(CrispEditError, match="only 2"):
        capability_corpus(p, 3)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"txt": 1}\n')
    with pytest.raises(CrispEditError, match="no string 'text'"):
        load_texts(bad)


def test_encode_pairs_masks_prompt_and_padding(tiny_tok):
    b = encode_pairs(tiny_tok, ["Which river is it?", "Q?"], ["Chichester River", "A"])
    for i, (p, t) in enumerate([("Which river is it?", "Chichester River"), ("Q?", "A")]):
        n_prompt = len(tiny_tok(p)["input_ids"])
        full = tiny_tok(p + " " + t)["input_ids"]
        row = b.labels[i]
        assert (row[:n_prompt] == -100).all()
        assert row[n_prompt : len(full)].tolist() == full[n_prompt:]
        assert (row[len(full) :] == -100).all() and b.attention_mask[i].sum() == len(full)
        assert b.target_lengths[i] == len(full) - n_prompt
