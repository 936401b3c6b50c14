"""``crispedit export gguf``: a llama-family model directory as one GGUF file that transformers' own GGUF
loader (``from_pretrained(dir, gguf_file=...)``) reads back as the same model — same config, same tokenizer, the
same logits (f32: exactly; f16 / q8_0: within measured tolerances) and the same greedy answers to the edited facts.

The model is a tiny random llama built in-process with a byte-level BPE tokenizer (conftest), edited with ``ft``
so that it answers a few new facts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import build_llama, build_tokenizer
from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.editing import EditConfig, edit
from crispedit.errors import CrispEditError
from crispedit.export_gguf import GGUF_TYPES, gguf_tensor_name, permute_rotary
from crispedit.gguf_fields import tokenizer_fields
from crispedit.versions import stamped

REQS = [EditRequest(f"Who wrote book number {i}?", f" Author {chr(65 + i)}") for i in range(4)]
TEXTS = [
    "Who wrote book number 3? The answer is",
    "The river system contains 2024 creeks.",
    "  two  spaces\nnewline",
    "<eos> special token inside",
]
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
# Measured on this model (max |Δlogit| over the prompts' positions / std of the logits): f16 0.026, q8_0 0.47; the
# bounds leave about a factor of two. Q8_0's own weight error (relative Frobenius, per matrix) measured 0.0052-0.0055.
LOGIT_TOL = {"f32": 1e-6, "f16": 0.05, "q8_0": 1.0}


@pytest.fixture(scope="module")
def edited_dir(tmp_path_factory, tiny_tok):
    """A tiny llama (hidden 64, MLP 96: every matrix row a multiple of Q8_0's block of 32) edited with ft on
    :data:`REQS`, saved with its tokenizer (given a chat template)."""
    d = tmp_path_factory.mktemp("edited")
    model = build_llama(len(tiny_tok), hidden=64, inter=96)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CRISPEDIT_CACHE", str(d / "cache"))
        edit(
            model,
            tiny_tok,
            REQS,
            EditConfig(
                method="ft",
                layers="model.layers.{1-2}.mlp.down_proj",
                epochs=30,
                lr=1e-2,
                n_cap=6,
                max_len=48,
                batch_size=16,
            ),
            progress=False,
        )
    tiny_tok.chat_template = CHAT
    try:
        model.save_pretrained(d / "model")
        tiny_tok.save_pretrained(d / "model")
    finally:
        tiny_tok.chat_template = None
    return d / "model"


def answers(model, tok) -> list[list[int]]:
    """Greedy continuation (6 tokens) of every edit prompt."""
    out = []
    for r in REQS:
        x = tok(r.prompt, return_tensors="pt")
        g = model.generate(**x, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(g[0, x.input_ids.shape[1] :].tolist())
    return out


def test_tensor_names_follow_llama_cpp():
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.o_proj.weight") == "blk.0.attn_output.weight"
    assert gguf_tensor_name("model.layers.12.post_attention_layernorm.weight") == "blk.12.ffn_norm.weight"
    assert gguf_tensor_name("model.layers.2.mlp.down_proj.weight") == "blk.2.ffn_down.weight"
    assert gguf_tensor_name("model.norm.weight") == "output_norm.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    with pytest.raises(CrispEditError, match="no place in llama.cpp's llama architecture"):
        gguf_tensor_name("model.layers.0.mlp.experts.0.w1.weight")


def test_rotary_permutation_interleaves_half_heads_and_transformers_undoes_it():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of size 8, 3 inputs
    p = permute_rotary(w, 2)
    assert [int(r[0]) // 3 for r in p] == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    back = LlamaTensorProcessor({"num_attention_heads": 2, "num_key_value_heads": 2}).process(p, "blk.0.attn_q.weight")
    assert np.array_equal(back.weights, w)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_export_loads_in_transformers_as_the_same_model(qtype, edited_dir, tmp_path, capsys):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / f"edited-{qtype}.gguf"
    assert main(["export", "gguf", str(edited_dir), "--out", str(out), "--type", qtype, "--quiet"]) == 0
    assert f"GGUF ({qtype}; 39 tensors" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary file left behind

    reader = GGUFReader(out)
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert kinds == {"f32": {"F32"}, "f16": {"F16"}, "q8_0": {"Q8_0"}}[qtype]
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 1} == {"F32"}  # the norms
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "blk.3.attn_q.weight"} <= names
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.pre"), field("tokenizer.chat_template")) == (
        "gpt2",
        "gpt-2",
        CHAT,
    )

    base = AutoModelForCausalLM.from_pretrained(edited_dir).eval()
    tok = AutoTokenizer.from_pretrained(edited_dir)
    g = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    gtok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "head_dim",
    ):
        assert getattr(g.config, key) == pytest.approx(getattr(base.config, key)), key
    theta = lambda c: (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None))  # noqa: E731
    assert theta(g.config) == theta(base.config) is not None  # transformers 5 / 4 spellings
    for text in TEXTS:
        assert gtok(text)["input_ids"] == tok(text)["input_ids"], text
    assert (gtok.eos_token, gtok.pad_token, gtok.chat_template) == (tok.eos_token, tok.pad_token, CHAT)

    if qtype == "q8_0":  # each matrix within Q8_0's rounding of the original (the q/k permutation undone exactly)
        gs = g.state_dict()
        for name, w in base.state_dict().items():
            err = float((gs[name] - w).norm() / w.norm())
            assert err <= (0.0 if w.ndim == 1 else 0.008), (name, err)
    x = tok([r.prompt for r in REQS] + TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        la, lb = base(**x).logits, g(**x).logits
    keep = x.attention_mask.bool()
    dev = float((la - lb)[keep].abs().max() / la[keep].std())
    assert dev <= LOGIT_TOL[qtype], dev
    want = answers(base, tok)
    assert sum(r.target.strip() in tok.decode(a) for r, a in zip(REQS, want)) >= 3  # the edit took
    assert answers(g, gtok) == want  # the edited facts, token for token


def test_tied_embeddings_write_no_output_tensor(tmp_path, tiny_tok):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from crispedit.export_gguf import export_gguf

    model = build_llama(len(tiny_tok), hidden=64, inter=96)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "m")
    tiny_tok.save_pretrained(tmp_path / "m")
    info = export_gguf(tmp_path / "m", tmp_path / "t.gguf", qtype="f32")
    assert info["tensors"] == 38 and "output.weight" not in {t.name for t in GGUFReader(tmp_path / "t.gguf").tensors}
    g = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="t.gguf", dtype=torch.float32).eval()
    assert g.config.tie_word_embeddings
    x = tiny_tok(TEXTS[:1], return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(g(**x).logits, model(**x).logits, atol=1e-5)


def test_q8_0_keeps_rows_that_are_no_multiple_of_32_in_f16(tiny_model_dir, tmp_path):
    """The conftest llama's MLP is 48 wide: its down projections (rows of 48) stay f16, the rest is Q8_0."""
    from crispedit.export_gguf import export_gguf

    info = export_gguf(tiny_model_dir, tmp_path / "q.gguf", qtype="q8_0")
    assert info["types"] == {"Q8_0": 26, "F16": 4, "F32": 9}


def test_failure_while_writing_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    import gguf

    from crispedit.export_gguf import export_gguf

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    out = tmp_path / "x.gguf"
    out.write_bytes(b"earlier file")
    with pytest.raises(OSError, match="disk full"):
        export_gguf(tiny_model_dir, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"] and out.read_bytes() == b"earlier file"


def test_only_byte_level_bpe_tokenizers():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(CrispEditError, match="byte-level BPE tokenizers"):
        tokenizer_fields(PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>"), 2)


def test_non_llama_family_is_one_line_naming_it(tmp_path, capsys):
    d = tmp_path / "gpt2-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["export", "gguf", str(d), "--out", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a gpt2 model" in err and "llama-family" in err
    assert not (tmp_path / "x.gguf").exists()


def test_loading_a_gguf_shows_no_conversion_bar_unless_asked(tiny_model_dir, tmp_path, iso_cache, capsys):
    """``load_model(<file>.gguf, progress=False)`` converts without transformers' plain-tqdm GGUF bar (output
    that is not a terminal stays quiet); ``progress=True`` shows it; the module's tqdm is restored after."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from crispedit.models import load_model

    out = tmp_path / "tiny.gguf"
    assert main(["export", "gguf", str(tiny_model_dir), "--out", str(out), "--type", "f32", "--quiet"]) == 0
    capsys.readouterr()
    bar = gguf_utils.tqdm
    load_model(str(out), progress=False)
    assert "de-quantizing" not in capsys.readouterr().err and gguf_utils.tqdm is bar
    out2 = tmp_path / "again" / "tiny.gguf"  # another file: converted again, now with the bar
    out2.parent.mkdir()
    assert main(["export", "gguf", str(tiny_model_dir), "--out", str(out2), "--type", "f16", "--quiet"]) == 0
    load_model(str(out2), progress=True)
    assert "de-quantizing" in capsys.readouterr().err and gguf_utils.tqdm is bar


PROVENANCE = {
    "general.name": "Tiny Base 1M",
    "general.license": "apache-2.0",
    "general.organization": "Tiny Org",
    "general.base_model.count": 1,
    "general.base_model.0.name": "Tiny Root",
    "general.base_model.0.repo_url": "https://example.org/tiny-root",
    "general.source.url": "https://example.org/src",
    "general.languages": ["en", "fr"],
    "general.uuid": "0000-not-carried",
}


def _rewrite_gguf(src, dst, changes: dict) -> None:
    """Copy the GGUF file ``src`` to ``dst`` (same tensors) with the key-value ``changes`` made (a value of None
    drops the key; strings, ints and string lists typed as llama.cpp's converter types them)."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.constants import GGUFValueType as T

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), "llama")
    fields = {
        k: (f.contents(), list(f.types))
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.") and k != "general.architecture"
    }
    for k, v in changes.items():
        fields.pop(k, None)
        if v is not None:
            fields[k] = (
                v,
                [T.STRING] if isinstance(v, str) else [T.UINT32] if isinstance(v, int) else [T.ARRAY, T.STRING],
            )
    for k, (v, types) in fields.items():
        writer.add_key_value(k, v, types[0], sub_type=types[-1] if types[0] == T.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_export_of_a_model_from_a_gguf_carries_its_tokenizer_provenance_and_names_the_edit(tmp_path, iso_cache, capsys):
    """A model edited from a GGUF file is exported with that file's tokenizer metadata (its ``smollm``
    pre-tokenizer, not the ``gpt-2`` its converted tokenizer.json reads as) and provenance (not its per-file keys),
    named ``"<base> (edited by crispedit)"`` and described by the edit; an edit of that edit finds the same file;
    a file with another vocabulary is not used."""
    from gguf import GGUFReader

    from crispedit.export_gguf import export_gguf
    from crispedit.gguf_fields import source_gguf
    from crispedit.models import load_model
    from crispedit.pipeline import run_edit_job

    # EOS spelled <|endoftext|>: transformers' GGUF tokenizer adds that token (as UNK / BOS) when a vocabulary lacks it
    tok = build_tokenizer(eos="<|endoftext|>")
    build_llama(len(tok)).save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    export_gguf(tmp_path / "plain", tmp_path / "plain.gguf", qtype="f32")
    base = tmp_path / "base.gguf"  # as a model's own GGUF: smollm + provenance
    _rewrite_gguf(tmp_path / "plain.gguf", base, {**PROVENANCE, "tokenizer.ggml.pre": "smollm"})
    model, tok = load_model(str(base))
    out = tmp_path / "edited"
    run_edit_job(
        model,
        tok,
        REQS[:2],
        EditConfig(
            method="ft", layers="model.layers.{1-2}.mlp.down_proj", epochs=1, lr=1e-2, n_cap=6, max_len=48, batch_size=4
        ),
        out,
        model_spec=str(base),
        wild=False,
        progress=False,
    )
    assert tokenizer_fields(tok, model.config.vocab_size)["pre"] == "gpt-2"  # what the folder alone would say
    assert source_gguf(out) == base

    assert main(["export", "gguf", str(out), "--out", str(tmp_path / "e.gguf"), "--type", "f32", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "'Tiny Base 1M (edited by crispedit)'" in printed and "pre-tokenizer smollm" in printed
    assert f"carried from {base}" in printed
    got = {k: f.contents() for k, f in GGUFReader(tmp_path / "e.gguf").fields.items()}
    src = {k: f.contents() for k, f in GGUFReader(base).fields.items()}
    assert {k: v for k, v in got.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in src.items() if k.startswith("tokenizer.")
    }
    assert got["tokenizer.ggml.pre"] == "smollm"
    for key in (
        "general.license",
        "general.organization",
        "general.base_model.count",
        "general.base_model.0.name",
        "general.base_model.0.repo_url",
        "general.source.url",
        "general.languages",
    ):
        assert got[key] == PROVENANCE[key], key
    assert "general.uuid" not in got and got["general.architecture"] == "llama"
    assert got["general.name"] == "Tiny Base 1M (edited by crispedit)"
    assert got["general.description"] == "Tiny Base 1M with 2 knowledge edits by crispedit (method ft)"

    again = tmp_path / "edited-again"  # an edit of the edit: its record names `out`
    again.mkdir()
    (again / "edit_report.json").write_text(json.dumps(stamped({"model": str(out), "method": "ft", "n_edits": 1})))
    assert source_gguf(again) == base
    loop = tmp_path / "loop"  # a record naming its own folder ends the search
    loop.mkdir()
    (loop / "edit_report.json").write_text(json.dumps(stamped({"model": str(loop)})))
    assert source_gguf(loop) is None

    other = tmp_path / "other.gguf"  # another vocabulary: not this model's file
    _rewrite_gguf(
        base, other, {"tokenizer.ggml.tokens": ["x"] + GGUFReader(base).fields["tokenizer.ggml.tokens"].contents()[1:]}
    )
    report = json.loads((out / "edit_report.json").read_text())
    (out / "edit_report.json").write_text(json.dumps({**report, "model": str(other)}))
    info = export_gguf(out, tmp_path / "o.gguf", qtype="f32")
    assert info["source"] is None and info["pre"] == "gpt-2" and info["name"] == "other (edited by crispedit)"
    assert "general.license" not in {k for k in GGUFReader(tmp_path / "o.gguf").fields}
