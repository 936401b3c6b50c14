import dataclasses
import os

import pytest
import torch

from crispedit.curvature.cache import CurvatureSpec, cache_key, get_or_build_factors, load_factors, save_factors
from crispedit.curvature.factors import KFACFactors
from crispedit.errors import CrispEditError
from crispedit.layers import resolve_layers
from crispedit.weights import weight_fingerprint

SPEC = CurvatureSpec(
    model_fingerprint="f" * 32,
    layers=("a", "b"),
    corpus_digest="c" * 32,
    n_texts=8,
    max_len=64,
    label_mode="sampled",
    seed=0,
)


def factors():
    return KFACFactors({"a": torch.eye(3), "b": torch.eye(2)}, {"a": torch.eye(2), "b": torch.eye(4)}, 11)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fingerprint", "g" * 32),
        ("layers", ("a",)),
        ("corpus_digest", "d"),
        ("n_texts", 9),
        ("max_len", 128),
        ("label_mode", "empirical"),
        ("seed", 1),
        ("stat_dtype", "float64"),
        ("model_dtype", "bfloat16"),
    ],
)
def test_key_covers_every_field(field, value):
    assert cache_key(dataclasses.replace(SPEC, **{field: value})) != cache_key(SPEC)


def test_roundtrip_and_refusals(tmp_path):
    path = save_factors(tmp_path / "f.safetensors", factors(), SPEC)
    f = load_factors(path, SPEC)
    assert torch.equal(f.A["a"], torch.eye(3)) and f.n_tokens == 11
    with pytest.raises(CrispEditError, match="another model"):
        load_factors(path, model_fingerprint="0" * 32)
    with pytest.raises(CrispEditError, match="layers"):
        load_factors(path, model_fingerprint=SPEC.model_fingerprint, layers=["a"])
    with pytest.raises(CrispEditError, match="different configuration"):
        load_factors(path, dataclasses.replace(SPEC, seed=5))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_truncated_and_foreign_files(tmp_path):
    path = save_factors(tmp_path / "f.safetensors", factors(), SPEC)
    data = path.read_bytes()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CrispEditError, match="truncated or corrupt"):
        load_factors(bad)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CrispEditError, match="truncated or corrupt"):
        load_factors(junk)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(CrispEditError, match="not a crispedit"):
        load_factors(other)
    with pytest.raises(CrispEditError, match="not found"):
        load_factors(tmp_path / "missing.safetensors")


def test_shared_safetensors_reader_names_every_problem_in_one_line(tmp_path):
    """``read_safetensors_header`` / ``load_safetensors`` (the reader of cache, MEND network, delta and session
    files): one line naming the file kind for each way a file can be wrong."""
    import json

    from safetensors.torch import save_file

    from crispedit.safetensors_io import load_safetensors, read_safetensors_header

    good = tmp_path / "good.safetensors"
    save_file({"x": torch.arange(6.0).reshape(2, 3)}, str(good), metadata={"k": json.dumps({"a": 1}), "n": "7"})
    meta, table = read_safetensors_header(good, "thing", "k")
    assert meta == {"a": 1} and table["x"]["shape"] == [2, 3] and table["x"]["dtype"] == "F32"
    assert read_safetensors_header(good, "thing", None)[0]["n"] == "7"
    meta, tensors = load_safetensors(good, "thing", "k")
    assert meta == {"a": 1} and torch.equal(tensors["x"], torch.arange(6.0).reshape(2, 3))
    data = good.read_bytes()
    cases = {
        "short": (data[:5], "thing file .* is not a safetensors file, or is truncated or corrupt"),
        "cut-header": (data[:20], "truncated or corrupt"),
        "cut-data": (data[:-4], "truncated or corrupt .*the header describes 24 bytes of data"),
        "junk": (b"not a safetensors file", "is not a safetensors file"),
        "list-header": (b"\x02" + b"\0" * 7 + b"[]", "header is not an object"),
        "list-metadata": (b"\x15" + b"\0" * 7 + b'{"__metadata__": [1]}', "header is not an object"),
    }
    for name, (raw, match) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(CrispEditError, match=match) as exc:
            read_safetensors_header(tmp_path / name, "thing", "k")
        assert "\n" not in str(exc.value), name
    for md, match in (
        ({"other": "1"}, "is not a crispedit thing \\(no k metadata\\)"),
        ({"k": "{not json"}, "thing file .* has corrupt metadata"),
        ({"k": "[1, 2]"}, "has corrupt metadata"),
    ):
        f = tmp_path / "foreign.safetensors"
        save_file({"x": torch.zeros(1)}, str(f), metadata=md)
        with pytest.raises(CrispEditError, match=match):
            load_safetensors(f, "thing", "k")
    with pytest.raises(CrispEditError, match="thing file not found"):
        load_safetensors(tmp_path / "absent", "thing", "k")
    with pytest.raises(CrispEditError, match="is a directory"):
        read_safetensors_header(tmp_path, "thing", "k")


def test_get_or_build_reuses_and_rebuilds(tiny_lm, tmp_path, monkeypatch):
    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    spec = dataclasses.replace(SPEC, model_fingerprint=weight_fingerprint(model), layers=tuple(layers))
    texts = ["one text here for the cache", "and another one"]
    f1, info1 = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    assert not info1["hit"]
    import crispedit.curvature.cache as cache_mod

    calls = []
    real = cache_mod.collect_lm_kfac
    monkeypatch.setattr(cache_mod, "collect_lm_kfac", lambda *a, **k: calls.append(1) or real(*a, **k))
    f2, info2 = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    assert info2["hit"] and not calls
    assert torch.equal(f1.S["model.layers.1.mlp.down_proj"], f2.S["model.layers.1.mlp.down_proj"])
    # a damaged entry is rebuilt, not used
    p = tmp_path / "kfac" / f"{cache_key(spec)}.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    f3, info3 = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    assert not info3["hit"] and calls


def test_fingerprint_tracks_weights(tiny_lm):
    model, _ = tiny_lm
    fp = weight_fingerprint(model)
    assert fp == weight_fingerprint(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    assert weight_fingerprint(model) != fp


def test_fingerprint_format(tiny_lm):
    """XXH3 fingerprints name their hash: ``xxh3-`` and 32 hex digits."""
    model, _ = tiny_lm
    fp = weight_fingerprint(model)
    assert fp.startswith("xxh3-") and len(fp) == 37 and int(fp[5:], 16) >= 0


def test_atomic_writes_leave_normal_permissions(tmp_path):
    """safetensors writes 0600 files; crispedit's outputs (caches, sessions, saved models) follow the umask."""
    import stat

    from safetensors.torch import save_file

    from crispedit.atomic import atomic_directory, atomic_save_safetensors, atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_save_safetensors(tmp_path / "t.safetensors", {"x": torch.zeros(2)})
        atomic_write_json(tmp_path / "j.json", {"a": 1})
        with atomic_directory(tmp_path / "model") as d:
            save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    finally:
        os.umask(old)
    for f in (tmp_path / "t.safetensors", tmp_path / "j.json", tmp_path / "model" / "model.safetensors"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o644, f
    assert stat.S_IMODE(os.stat(tmp_path / "model").st_mode) == 0o755


def _count_eigh(monkeypatch):
    """Count the eigendecompositions :mod:`crispedit.curvature.eigen` runs."""
    import crispedit.curvature.eigen as eigen_mod

    calls = []
    real = eigen_mod.eigh_psd
    monkeypatch.setattr(eigen_mod, "eigh_psd", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_eigenbases_cached_beside_the_factors(tiny_lm, tmp_path, monkeypatch):
    """The projector of a cached eigenbasis is the projector of the factors, bit for bit; a second load of the
    same factors decomposes nothing; a rebuilt factor file (same key) or a damaged eigenbasis file is
    decomposed again; merged (in-memory) factors are never written."""
    from crispedit.curvature.eigen import eigen_cache_path, factor_eigh
    from crispedit.curvature.projection import KroneckerProjector

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    spec = dataclasses.replace(SPEC, model_fingerprint=weight_fingerprint(model), layers=tuple(layers))
    texts = ["one text here for the cache", "and another one"]
    calls = _count_eigh(monkeypatch)
    f1, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    eig = factor_eigh(f1, layers)
    assert len(calls) == 4
    path = eigen_cache_path(f1)
    assert path == tmp_path / "eigh" / f"{cache_key(spec)}.safetensors" and path.is_file()
    assert not list((tmp_path / "kfac").glob("*eigh*"))  # `cache list` sees factor files only
    for name in layers:
        ref = KroneckerProjector.from_factors(f1.A[name], f1.S[name], 0.8)
        got = KroneckerProjector.from_spectra(*eig[name, "S"], *eig[name, "A"], 0.8)
        assert torch.equal(ref.mask, got.mask) and torch.equal(ref.U_in, got.U_in) and torch.equal(ref.U_out, got.U_out)
        Q = torch.randn(ref.d_out, ref.d_in)
        assert torch.equal(ref.project(Q), got.project(Q))
    factor_eigh(f1, layers)  # memo on the object
    assert len(calls) == 4
    f2, info = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    assert info["hit"]
    eig2 = factor_eigh(f2, layers)
    assert len(calls) == 4 and all(torch.equal(eig[k][1], eig2[k][1]) for k in eig)
    # rebuilt factors (same key, new file): their eigenbases are recomputed, not taken from the old file
    f3, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, force=True, progress=False)
    assert f3.source["write"] != f1.source["write"]
    factor_eigh(f3, layers)
    assert len(calls) == 8
    # a damaged eigenbasis file is recomputed and replaced
    path.write_bytes(path.read_bytes()[:200])
    f4, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    n = len(calls)
    factor_eigh(f4, layers, ("A",))
    assert len(calls) == n + 2
    f5, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    factor_eigh(f5, layers, ("A",))
    assert len(calls) == n + 2
    # a file decomposed in another arithmetic (float32) is decomposed again here; the check runs both ways
    from crispedit.curvature import eigen

    monkeypatch.setattr(eigen, "eigh_dtype", lambda device: torch.float32)  # a float32 decomposition
    f6, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    eig6 = factor_eigh(f6, layers, ("A",))
    assert len(calls) == n + 4 and all(v[0].dtype == torch.float64 for v in eig6.values())
    f7, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    factor_eigh(f7, layers, ("A",))
    assert len(calls) == n + 4  # the float32 file serves float32
    monkeypatch.undo()
    calls = _count_eigh(monkeypatch)
    f8, _ = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path, progress=False)
    factor_eigh(f8, layers, ("A",))
    assert len(calls) == 2  # today's float64 (every device): decomposed again
    merged = f1.merged(f1)
    assert merged.source == {} and eigen_cache_path(merged) is None
    with pytest.raises(CrispEditError, match="no S factor"):
        factor_eigh(KFACFactors({"x": torch.eye(2)}, {}, 3), ["x"], ("S",))


CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_cap_chat_adds_the_models_own_chat_answers_to_the_capability_corpus(tiny_lm, tmp_path, monkeypatch):
    """With ``cap_chat`` the capability corpus is the texts plus chat transcripts of the model's own greedy answers,
    of which only the answer positions count; the cache key names the prompts (not the answers), so a cached
    entry is found without generating them; ``cap_chat`` 0 keeps the text-only key."""
    import copy

    from crispedit.data.corpus import chat_prompts
    from crispedit.editing import EditConfig, capability_factors, curvature_spec
    from crispedit.editing.api import capability_sequences
    from crispedit.evaluation import generation
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    plain, chat = EditConfig(n_cap=4, layers=None), EditConfig(n_cap=4, cap_chat=3)
    s0, s1 = curvature_spec(model, list(layers), plain), curvature_spec(model, list(layers), chat)
    assert s0.corpus_digest != s1.corpus_digest and (s0.n_texts, s1.n_texts) == (4, 7)
    seqs, loss_from = capability_sequences(model, tok, chat)
    assert len(seqs) == 7 and loss_from[:4] == [0] * 4 and all(k > 0 for k in loss_from[4:])
    for p, ids, k in zip(chat_prompts(3), seqs[4:], loss_from[4:]):
        text = tok.decode(ids)
        assert text.startswith(f"<|user|>{p}<eos><|assistant|>") and tok.decode(ids[:k]).endswith("<|assistant|>")
    assert capability_sequences(model, tok, plain) == (
        list(__import__("crispedit").data.capability_corpus(None, 4)),
        None,
    )

    calls = []
    real = generation.generate_answers
    monkeypatch.setattr(generation, "generate_answers", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    f1, info1 = capability_factors(model, tok, layers, chat, cache_root=tmp_path)
    f2, info2 = capability_factors(model, tok, layers, chat, cache_root=tmp_path)
    assert (info1["hit"], info2["hit"], len(calls)) == (False, True, 1)
    f0, _ = capability_factors(model, tok, layers, plain, cache_root=tmp_path)
    name = next(iter(layers))
    assert f1.n_tokens > f0.n_tokens and not torch.allclose(f1.A[name], f0.A[name])
    assert torch.equal(f1.A[name], f2.A[name])


def test_cap_chat_out_of_range_is_one_line():
    from crispedit.editing import EditConfig
    from crispedit.errors import CrispEditError

    with pytest.raises(CrispEditError, match="cap-chat"):
        EditConfig(cap_chat=10_000)
    with pytest.raises(CrispEditError, match="cap-chat"):
        EditConfig(cap_chat=-1)
