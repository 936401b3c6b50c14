"""benchmarks/seq_room.py: the room a stream's accumulated edit factors leave later rounds, without training."""

from conftest import REPO, load_script
from crispedit.curvature.kfac import collect_lm_kfac
from crispedit.data import EditRequest
from crispedit.editing import EditConfig, SeqConfig
from crispedit.editing.registry import get_editor
from crispedit.weights import weight_fingerprint

REQS = [EditRequest(f"Who founded company {i}?", f"Person {chr(65 + i)}") for i in range(6)]


def _setup(model, tok):
    """A crispedit-seq config on the tiny model's two middle MLP outputs, those layers, and capability factors of
    those layers from four copies of one sentence."""
    config = SeqConfig(
        edit=EditConfig(
            method="crispedit", layers="model.layers.{1-2}.mlp.down_proj", contexts="bare", n_cap=4, max_len=48
        )
    )
    layers = get_editor("crispedit").select_layers(model, config.edit)
    texts = ["The quick brown fox jumps over the lazy dog."] * 4
    return config, layers, collect_lm_kfac(model, tok, texts, layers, max_len=48, batch_size=2, progress=False)


def test_room_per_setting_and_round_from_the_unedited_model(tiny_lm, iso_cache):
    script = load_script(REPO / "benchmarks" / "seq_room.py", "seq_room")
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    config, layers, cap = _setup(model, tok)
    seen = []
    series = script.room(
        model, tok, REQS, layers, config, cap, 2, ["full", "target"], [0.95, 0.5], on_round=lambda s: seen.append(1)
    )
    assert weight_fingerprint(model) == fp  # nothing trains
    assert set(series) == {"full@0.95", "full@0.5", "target@0.95", "target@0.5"} and len(seen) == 2
    first = script.kept(cap, layers, config.edit.gamma)
    for v in series.values():
        assert len(v) == 3 and v[0] == round(sum(first.values()) / len(first), 4)  # round 1: the capability alone
        assert all(0.0 <= x <= 1.0 for x in v)
    for rows in ("full", "target"):  # masking less of the edit energy leaves at least as much room, round by round
        assert all(a >= b for a, b in zip(series[f"{rows}@0.5"], series[f"{rows}@0.95"]))
    # the edit factors take room: each round's constraint keeps less than the capability alone, and under the
    # default edit gamma the stream keeps less after two rounds than after one
    assert all(x < v[0] for v in series.values() for x in v[1:])
    assert series["full@0.95"][2] < series["full@0.95"][1]
    assert "| full@0.95 |" in script.table(series)


def test_gradient_shares_weigh_the_kept_directions_by_what_the_edits_ask(tiny_lm, iso_cache):
    """The share of an edit's gradient a projector keeps: all of it for the identity, none for a projector that
    zeroes everything, between for a K-FAC constraint; per wrapper, averaged over the edits; nothing trains and
    the weights' ``requires_grad`` is left as it was. ``room`` adds the shares of every later round's edits under
    each setting and the capability constraint alone."""
    from crispedit.curvature.projection import IdentityProjector

    script = load_script(REPO / "benchmarks" / "seq_room.py", "seq_room")
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    config, layers, cap = _setup(model, tok)
    before = {n: m.weight.requires_grad for n, m in layers.items()}

    class Zero(IdentityProjector):
        def project(self, Q):
            return Q * 0

    same = {n: IdentityProjector(*m.weight.shape) for n, m in layers.items()}
    none = {n: Zero(*m.weight.shape) for n, m in layers.items()}
    shares = script.gradient_shares(model, tok, REQS[:3], layers, {"id": same, "zero": none}, ["qa", "none"])
    assert shares == {"qa": {"id": 1.0, "zero": 0.0}, "none": {"id": 1.0, "zero": 0.0}}
    assert {n: m.weight.requires_grad for n, m in layers.items()} == before and weight_fingerprint(model) == fp
    series = script.room(model, tok, REQS, layers, config, cap, 2, ["full"], [0.95], wrappers=["qa"])
    assert set(series["gradient_share"]) == {"2", "3"}  # rounds after the first
    for per in series["gradient_share"].values():
        assert set(per["qa"]) == {"capability", "full@0.95"} and all(0.0 <= x <= 1.0 for x in per["qa"].values())
    assert "round 2's edits: share of their gradient kept" in script.table(series)


def test_room_compares_weightings_and_the_curvature_a_step_costs(tiny_lm, iso_cache):
    """``weightings``: each setting once per weighting (``apart`` once per sweep count), keyed by
    :func:`setting_name`; ``exposure``: per setting, the capability and earlier-edit curvature of the projected QA
    gradients over the raw ones' — 1 for no projection, below 1 under a constraint that masks that curvature."""
    from crispedit.curvature.projection import IdentityProjector

    script = load_script(REPO / "benchmarks" / "seq_room.py", "seq_room")
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    config, layers, cap = _setup(model, tok)
    series = script.room(
        model,
        tok,
        REQS[:4],
        layers,
        config,
        cap,
        2,
        ["full"],
        [0.8],
        wrappers=["qa"],
        weightings=["each", "apart"],
        sweeps=[1, 3],
        exposure=True,
    )
    assert weight_fingerprint(model) == fp
    names = {"full@0.8", "full@0.8:apart1", "full@0.8:apart3"}
    assert set(series) == names | {"gradient_share", "exposure"}
    assert set(series["gradient_share"]["2"]["qa"]) == names | {"capability"}
    exp = series["exposure"]["2"]
    assert set(exp) == names | {"capability"} and all(set(v) == {"capability", "edits"} for v in exp.values())
    assert all(0.0 <= x <= 1.0 + 1e-6 for v in exp.values() for x in v.values())
    assert exp["full@0.8:apart3"]["edits"] < exp["capability"]["edits"]  # the edit mask is what protects them
    same = {n: IdentityProjector(*m.weight.shape) for n, m in layers.items()}
    ident = script.curvature_exposure(model, tok, REQS[:2], layers, {"id": same}, {"capability": cap})
    assert ident == {"id": {"capability": 1.0}}
    assert script.setting_name("target", 0.95, "trace", "each") == "target@0.95:trace"
    assert "curvature of the projected step over the raw step's" in script.table(series)
    both = script.room(
        model, tok, REQS[:4], layers, config, cap, 2, ["full", "target"], [0.8], wrappers=["qa"], exposure=True
    )  # with target rows beside full ones: also the curvature of the earlier edits' answers alone
    assert all(set(v) == {"capability", "edits", "edit targets"} for v in both["exposure"]["2"].values())
    assert both["exposure"]["2"]["full@0.8"]["edits"] == exp["full@0.8"]["edits"]


def test_stream_record_says_which_code_and_machine_ran_it():
    """A stream benchmark's record: the slice, chunk and model, and the environment with this checkout's commit."""
    from argparse import Namespace

    from crispedit.versions import source_commit

    script = load_script(REPO / "benchmarks" / "seq_retention.py", "seq_retention")
    record = script.stream_record(Namespace(edits="e.json:4:2", chunk=1, model="m"), [0, 1], extra=3)
    assert record["edits"] == {"file": "e.json", "offset": 4, "n": 2} and record["chunk"] == 1
    assert record["environment"]["source"] == source_commit() and record["extra"] == 3
