"""Shared fixtures: a tiny random-weight llama and a byte-level BPE tokenizer built in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Tiny models are faster on one thread, and CI machines are shared: avoid oversubscription.
torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REPO = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str | None = None):
    """The Python file ``path`` (relative to the repository root, e.g. ``benchmarks/scaling.py``, or absolute)
    imported as a module named ``name`` (default: its stem) — benchmark scripts and other files that are not
    in a package."""
    import importlib.util

    path = REPO / path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def edits_file(tmp_path, n=4):
    """An edit file ``tmp_path/edits.json`` of ``n`` made-up club founders (ZsRE schema, with subjects); its path."""
    import json

    recs = [
        {
            "src": f"Who founded club {i}?",
            "alt": f"Founder {chr(65 + i)}",
            "rephrase": f"Club {i} was founded by?",
            "loc": "nq question: who sang it",
            "loc_ans": "someone",
            "subject": f"club {i}",
        }
        for i in range(n)
    ]
    p = tmp_path / "edits.json"
    p.write_text(json.dumps(recs))
    return p


def build_tokenizer(vocab_size: int = 320, eos: str = "<eos>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from crispedit.data import bundled_path

    text = bundled_path("wikitext_capability.txt").read_text()[:20000].split("\n\n")
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token="<pad>")


def build_llama(
    vocab_size: int, *, layers: int = 4, hidden: int = 32, inter: int = 48, seed: int = 0, dtype=torch.float32
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.25,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    model.eval()
    return model


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Every test's crispedit cache is a directory of this session's (unless ``CRISPEDIT_CACHE`` is set when pytest
    starts): no test reads K-FAC factors or eigenbases another run of the suite left in the user's cache — the
    tiny models' weights, hence their cache keys, are the same in every run, so an entry written by older code
    would be found and used. (A test's ``monkeypatch.undo()`` also drops ``iso_cache``'s setting: it falls back to
    this one.) Converted models are shared with the user's cache (``models/``), so the GGUF is converted once."""
    import os

    from crispedit.models import cache_dir

    if os.environ.get("CRISPEDIT_CACHE"):
        yield Path(os.environ["CRISPEDIT_CACHE"])
        return
    user_models = cache_dir() / "models"
    root = tmp_path_factory.mktemp("crispedit_cache")
    user_models.mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(user_models, target_is_directory=True)
    os.environ["CRISPEDIT_CACHE"] = str(root)
    try:
        yield root
    finally:
        os.environ.pop("CRISPEDIT_CACHE", None)


@pytest.fixture(scope="session")
def tiny_tok():
    return build_tokenizer()


@pytest.fixture()
def tiny_lm(tiny_tok):
    return build_llama(len(tiny_tok)), tiny_tok


@pytest.fixture()
def tiny_lm64(tiny_tok):
    return build_llama(len(tiny_tok), dtype=torch.float64), tiny_tok


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tok):
    d = tmp_path_factory.mktemp("tiny_model")
    from crispedit.models import backend_as_loaded

    model = build_llama(len(tiny_tok))
    model.save_pretrained(d)
    with backend_as_loaded(tiny_tok):  # not the truncation an earlier test's tokenizer call left on the shared one
        tiny_tok.save_pretrained(d)
    return d


@pytest.fixture()
def iso_cache(tmp_path, monkeypatch):
    """A private crispedit cache dir (no process-wide state leaks between tests)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CRISPEDIT_CACHE", str(root))
    return root


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not available")
    return p
