"""KL drift on held-out text (evaluation/drift.py): the base's side kept between measures equals the plain one."""

import copy

import pytest
import torch

from crispedit.evaluation import drift as drift_mod
from crispedit.evaluation.drift import kl_drift

TEXTS = [
    f"The river number {i} flows past the old mill and into the sea near town {i % 3}." * (1 + i % 2) for i in range(7)
]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own cache root, so that no test reads the base side another stored (or damaged)."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    drift_mod._MEMO.clear()


def _changed(model, names, scale=0.05):
    """The current values of ``names`` (the base), then each perturbed in place."""
    base = {n: model.get_parameter(n).detach().clone() for n in names}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in names:
            p = model.get_parameter(n)
            p.add_(scale * torch.randn(p.shape, generator=g))
    return base


def _reference(model, tok, base):
    """The plain measure against a second model holding the base weights."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for n, w in base.items():
            other.get_parameter(n).copy_(w)
    return kl_drift(model, tok, TEXTS, base_model=other, max_len=32, batch_size=3)


@pytest.mark.parametrize(
    "names",
    [
        ["model.layers.2.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight"],
        ["model.layers.0.mlp.down_proj.weight"],
    ],
    ids=["block-2", "block-0"],
)
def test_kept_base_side_equals_the_plain_measure_and_is_reused(tiny_lm, names):
    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    base = _changed(model, names)
    want = _reference(model, tok, base)
    first = kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    (states,) = drift_mod._MEMO.values()
    assert states.k == int(names[0].split(".")[2]) and len(states.batches) == 3 and not states.plain
    with torch.no_grad():  # a later edit of the same base: only the edited side is computed again
        model.get_parameter(names[0]).mul_(1.5)
    later = kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    assert list(drift_mod._MEMO.values()) == [states]
    assert later["kl_drift"] == pytest.approx(_reference(model, tok, base)["kl_drift"], rel=1e-4)
    assert first["kl_drift"] > 0 and first["tokens"] == want["tokens"]
    for key in ("kl_drift", "ppl", "ppl_base"):
        assert first[key] == pytest.approx(want[key], rel=1e-4), key
    assert kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3, shared=False)[
        "kl_drift"
    ] == pytest.approx(later["kl_drift"], rel=1e-4)


def test_another_base_or_a_change_outside_the_blocks_is_measured_afresh(tiny_lm):
    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    base = _changed(model, ["model.layers.1.mlp.down_proj.weight"])
    kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    (before,) = drift_mod._MEMO.values()
    other = {n: w + 0.01 for n, w in base.items()}
    got = kl_drift(model, tok, TEXTS, base_weights=other, max_len=32, batch_size=3)
    (after,) = drift_mod._MEMO.values()
    assert after is not before
    assert got["kl_drift"] == pytest.approx(_reference(model, tok, other)["kl_drift"], rel=1e-4)
    outside = _changed(model, ["model.norm.weight"])
    drift_mod._MEMO.clear()
    got = kl_drift(model, tok, TEXTS, base_weights=outside, max_len=32, batch_size=3)
    assert not drift_mod._MEMO  # the final norm is not inside a decoder block: the plain measure
    assert got["kl_drift"] == pytest.approx(_reference(model, tok, outside)["kl_drift"], rel=1e-4)


def test_another_process_reads_the_stored_base_side(tiny_lm, monkeypatch):
    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    base = _changed(model, ["model.layers.2.mlp.down_proj.weight"])
    first = kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    (states,) = drift_mod._MEMO.values()
    assert states.stored and states.path.exists()
    drift_mod._MEMO.clear()  # as a new process: only the file is left

    def no_base_forward(*a, **k):
        raise AssertionError("the base side was computed again")

    monkeypatch.setattr(drift_mod, "capture_block_input", no_base_forward)
    again = kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    assert again == pytest.approx(first, rel=1e-6)


def test_a_stored_base_side_of_other_tokens_is_measured_again(tiny_lm):
    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    base = _changed(model, ["model.layers.1.mlp.down_proj.weight"])
    kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    (states,) = drift_mod._MEMO.values()
    drift_mod._MEMO.clear()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(states.path))
    tensors["ids.1"] = tensors["ids.1"].flip(1).contiguous()  # as if another tokenizer had encoded the texts
    from crispedit.safetensors_io import read_safetensors_header

    meta, _ = read_safetensors_header(states.path, "KL drift base cache", None)
    save_file(tensors, str(states.path), metadata=meta)
    got = kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    assert got["kl_drift"] == pytest.approx(_reference(model, tok, base)["kl_drift"], rel=1e-4)
    drift_mod._MEMO.clear()
    from safetensors.torch import load_file as reload

    assert torch.equal(reload(str(states.path))["ids.1"], tensors["ids.1"].flip(1))  # rewritten with the right ones


@pytest.mark.parametrize("damage", ["truncated", "other-base"])
def test_a_bad_stored_base_side_is_one_line(tiny_lm, damage):
    from crispedit.errors import CrispEditError

    model, tok = copy.deepcopy(tiny_lm[0]), tiny_lm[1]
    base = _changed(model, ["model.layers.2.mlp.down_proj.weight"])
    kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    (states,) = drift_mod._MEMO.values()
    drift_mod._MEMO.clear()
    if damage == "truncated":
        states.path.write_bytes(states.path.read_bytes()[:-100])
    else:
        import json

        from safetensors.torch import load_file, save_file

        from crispedit.safetensors_io import read_safetensors_header

        meta, _ = read_safetensors_header(states.path, "KL drift base cache", None)
        inner = json.loads(meta["crispedit_drift_base"])
        save_file(
            load_file(str(states.path)),
            str(states.path),
            metadata={"crispedit_drift_base": json.dumps({**inner, "fingerprint": "xxh3-0"})},
        )
    with pytest.raises(CrispEditError, match="KL drift base cache") as err:
        kl_drift(model, tok, TEXTS, base_weights=base, max_len=32, batch_size=3)
    assert "\n" not in str(err.value)
