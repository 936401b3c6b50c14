import pytest
import torch

from crispedit.errors import CrispEditError
from crispedit.families import FamilyDefaults, defaults_for
from crispedit.layers import default_layer_pattern, expand_pattern, family_defaults, model_family, resolve_layers
from crispedit.models import load_model


def test_expand_pattern():
    assert expand_pattern("model.layers.{1-3}.mlp.down_proj") == [f"model.layers.{i}.mlp.down_proj" for i in (1, 2, 3)]
    assert expand_pattern("a.{0,2-3}.b") == ["a.0.b", "a.2.b", "a.3.b"]
    assert expand_pattern("a.{1,2}.{x,y}") == ["a.1.x", "a.1.y", "a.2.x", "a.2.y"]
    assert expand_pattern("a.1.b, a.{1-2}.b") == ["a.1.b", "a.2.b"]
    with pytest.raises(CrispEditError):
        expand_pattern("a.{3-1}.b")


def test_resolve_layers_errors(tiny_lm):
    model, _ = tiny_lm
    with pytest.raises(CrispEditError, match="unknown layer 'model.layers.4.mlp.down_proj'"):
        resolve_layers(model, "model.layers.{2-9}.mlp.down_proj")
    with pytest.raises(CrispEditError, match="not a linear layer"):
        resolve_layers(model, "model.layers.1.mlp")
    assert list(resolve_layers(model, None)) == ["model.layers.0.mlp.down_proj"]


def _tiny(cfg_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(cfg_cls(**kw))


def test_default_patterns_per_family():
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    llama = _tiny(LlamaConfig, LlamaForCausalLM, num_hidden_layers=30, **common)
    assert default_layer_pattern(llama) == "model.layers.{4-8}.mlp.down_proj"  # SmolLM2's shape
    qwen = _tiny(Qwen2Config, Qwen2ForCausalLM, num_hidden_layers=8, **common)
    assert default_layer_pattern(qwen) == "model.layers.{1-2}.mlp.down_proj"
    mistral = _tiny(MistralConfig, MistralForCausalLM, num_hidden_layers=4, **common)
    assert default_layer_pattern(mistral) == "model.layers.{0}.mlp.down_proj"
    gpt2 = _tiny(GPT2Config, GPT2LMHeadModel, vocab_size=64, n_embd=16, n_layer=12, n_head=2)
    pat = default_layer_pattern(gpt2)
    assert pat == "transformer.h.{1-3}.mlp.c_proj"
    assert len(resolve_layers(gpt2, pat)) == 3  # GPT-2 Conv1D counts as linear
    try:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    except ImportError:  # pragma: no cover
        return
    gemma = _tiny(Gemma3TextConfig, Gemma3ForCausalLM, num_hidden_layers=18, head_dim=8, **common)
    # Gemma-3-270M's shape: its measured window {1-4} (crispedit.families), not the SmolLM2 rule's {2-5}
    assert default_layer_pattern(gemma) == "model.layers.{1-4}.mlp.down_proj"
    assert model_family(gemma) == "gemma3_text" and family_defaults(gemma).lr_scale == 0.1
    assert family_defaults(llama) == FamilyDefaults() and model_family(object()) is None


def test_family_lr_scales_only_a_default_shared_lr_and_only_once():
    """``EditConfig.for_family`` returns a new config: the shared DEFAULT_LR left unset becomes 5e-5 on Gemma-3
    (once, however often it is called); an lr the user gave, LoRA's own default and other families are kept, and
    the caller's config is left as it was."""
    from crispedit.editing import DEFAULT_LR, EditConfig

    assert defaults_for("gemma3").lr_scale == defaults_for("gemma3_text").lr_scale == 0.1
    assert defaults_for("llama") == defaults_for(None) == FamilyDefaults()
    cfg = EditConfig()
    scaled = cfg.for_family("gemma3_text")
    assert cfg.lr is None and cfg.learning_rate == DEFAULT_LR and scaled is not cfg and scaled.lr == 5e-5
    assert scaled.for_family("gemma3_text").lr == 5e-5 and scaled.validate().lr == 5e-5  # scaled once
    assert EditConfig(lr=1e-3).for_family("gemma3").lr == 1e-3  # the user's lr
    assert EditConfig(method="lora").for_family("gemma3").lr == 5e-3  # the method's own
    assert EditConfig().for_family("llama").lr == DEFAULT_LR
    ran = EditConfig().for_family("llama").to_json()  # what reports and sessions store: the lr that ran
    assert EditConfig.from_dict(ran).for_family("gemma3").lr == DEFAULT_LR


def test_load_model_specs(tiny_model_dir, tiny_tok, tmp_path):
    model, tok = load_model(str(tiny_model_dir))
    assert model.config.num_hidden_layers == 4 and tok.pad_token is not None and not model.training
    same = load_model((model, tok))
    assert same[0] is model
    with pytest.raises(CrispEditError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(CrispEditError, match="GGUF file not found"):
        load_model(str(tmp_path / "x.gguf"))
    with pytest.raises(CrispEditError, match="unknown dtype"):
        load_model(str(tiny_model_dir), dtype="float8")


def test_with_weights_swaps_in_and_restores_bit_for_bit_even_on_error(tiny_lm):
    """``with_weights`` puts the given values in for the block and the previous ones back after, exception or not."""
    from crispedit.weights import with_weights

    model, _ = tiny_lm
    name = "model.layers.1.mlp.down_proj.weight"
    p = model.get_parameter(name)
    before = p.detach().clone()
    other = torch.randn_like(before, dtype=torch.float64)  # any dtype: copied into the parameter's
    with with_weights(model, {name: other}):
        assert torch.equal(p, other.to(p.dtype))
    assert torch.equal(p, before)
    with pytest.raises(RuntimeError, match="boom"):
        with with_weights(model, {name: other}):
            raise RuntimeError("boom")
    assert torch.equal(p, before)
    with with_weights(model, None):
        assert torch.equal(p, before)


def test_parameter_reads_through_a_peft_wrapped_module(tiny_lm):
    """``<module>.weight`` of a module a LoRA adapter wraps is its base layer's weight (the name a LoRA session
    stores)."""
    from peft import LoraConfig, LoraModel

    from crispedit.weights import parameter

    model, _ = tiny_lm
    name = "model.layers.0.self_attn.q_proj.weight"
    w = model.get_parameter(name)
    tuner = LoraModel(model, LoraConfig(r=2, target_modules=["model.layers.0.self_attn.q_proj"]), "e")
    try:
        assert "model.layers.0.self_attn.q_proj.base_layer.weight" in dict(model.named_parameters())
        assert parameter(model, name) is w  # peft's `weight` property names the base layer's
    finally:
        tuner.merge_and_unload()


def test_last_logits_only_keeps_the_cache_and_the_last_logits(tiny_lm):
    """A forward with :func:`last_logits_only` leaves the KV cache a full forward's and its last logits equal up to
    rounding, and computes logits for that position alone; a forward without the argument gets no keyword arguments."""
    from crispedit.forward_args import last_logits_only

    model, _ = tiny_lm
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=True)
        short = model(input_ids=ids, use_cache=True, **last_logits_only(model))
    assert last_logits_only(model) == {"logits_to_keep": 1}
    assert short.logits.shape[1] == 1
    torch.testing.assert_close(short.logits[:, -1], full.logits[:, -1])  # one row vs nine: rounding only
    for (k1, v1), (k2, v2) in zip(
        ((c.keys, c.values) for c in full.past_key_values.layers),
        ((c.keys, c.values) for c in short.past_key_values.layers),
    ):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert last_logits_only(torch.nn.Linear(2, 2)) == {}


def _long_text(tok_json, n_min: int = 600) -> str:
    """A text that the ``tokenizers.Tokenizer`` read from ``tok_json`` encodes to at least ``n_min`` tokens."""
    text = "The river system contains many creeks, and each creek has a name. "
    while len(tok_json.encode(text).ids) < n_min:
        text += text
    return text


def assert_tokenizer_file_reads_as(folder, base):
    """``folder/tokenizer.json`` read with the ``tokenizers`` library (as servers read it) truncates and pads
    nothing, as ``base``'s, and encodes a 600-token text to the same 600+ ids."""
    from tokenizers import Tokenizer

    got, want = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (folder, base))
    assert (got.truncation, got.padding) == (want.truncation, want.padding) == (None, None)
    text = _long_text(want)
    assert len(want.encode(text).ids) >= 600 and got.encode(text).ids == want.encode(text).ids


def test_an_edited_folder_tokenizer_cuts_no_input(tiny_model_dir, tmp_path, iso_cache):
    """The evaluation's ``tokenizer(..., truncation=True, max_length=...)`` leaves truncation set on the fast
    tokenizer's backend; the edited folder's ``tokenizer.json`` must not carry it (nor padding)."""
    from crispedit.data import EditRequest
    from crispedit.editing import EditConfig
    from crispedit.pipeline import run_edit_job

    model, tok = load_model(str(tiny_model_dir))
    reqs = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(2)]
    cfg = EditConfig(
        method="ft", layers="model.layers.{1-2}.mlp.down_proj", epochs=1, lr=1e-2, batch_size=4, n_cap=6, max_len=48
    )
    run_edit_job(model, tok, reqs, cfg, tmp_path / "edited", model_spec=str(tiny_model_dir), wild=False, progress=False)
    assert_tokenizer_file_reads_as(tmp_path / "edited", tiny_model_dir)


def test_save_model_dir_writes_the_tokenizer_backend_as_loaded(tiny_model_dir, tmp_path):
    """Truncation and padding that calls left on the backend are not saved, and stay set in memory afterwards; a
    base whose own ``tokenizer.json`` truncates keeps exactly its setting; a tokenizer that did not come from
    ``load_model`` is saved with neither."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from crispedit.models import save_model_dir

    model, tok = load_model(str(tiny_model_dir))
    tok(["one short text", "and a second one"], truncation=True, max_length=16, padding=True)
    assert tok.backend_tokenizer.truncation["max_length"] == 16 and tok.backend_tokenizer.padding is not None
    save_model_dir(model, tok, tmp_path / "saved")
    assert_tokenizer_file_reads_as(tmp_path / "saved", tiny_model_dir)
    assert tok.backend_tokenizer.truncation["max_length"] == 16 and tok.backend_tokenizer.padding is not None

    base = tmp_path / "base-truncating"  # a base folder that truncates at 100 in its own file
    shutil.copytree(tiny_model_dir, base)
    spec = json.loads((base / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 100, "strategy": "LongestFirst", "stride": 0}
    (base / "tokenizer.json").write_text(json.dumps(spec))
    model, tok = load_model(str(base))
    tok(["one short text"], truncation=True, max_length=16)
    save_model_dir(model, tok, tmp_path / "saved2")
    saved = Tokenizer.from_file(str(tmp_path / "saved2" / "tokenizer.json"))
    assert saved.truncation == Tokenizer.from_file(str(base / "tokenizer.json")).truncation
    assert saved.truncation["max_length"] == 100 and saved.padding is None

    from conftest import build_tokenizer

    other = build_tokenizer()  # not from load_model
    other(["one short text"], truncation=True, max_length=16, padding="max_length")
    save_model_dir(model, other, tmp_path / "saved3")
    assert_tokenizer_file_reads_as(tmp_path / "saved3", tiny_model_dir)
