"""The edit engine's step: Adam gated on the device (no value read back inside a step) and equal to torch's Adam;
the loop's skip and stop rules decided without host syncs inside a step."""

import pytest
import torch

from crispedit.curvature.projection import IdentityProjector
from crispedit.data import EditRequest
from crispedit.editing import EditConfig, edit
from crispedit.editing.optim import EigenbasisAdam, GatedAdam

REQS = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(6)]


def _adam_pair(shape=(5, 7), lr=1e-2, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(*shape)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    return a, b, torch.optim.Adam([a], lr=lr, betas=(0.9, 0.999)), GatedAdam([b], lr=lr, betas=(0.9, 0.999))


@pytest.mark.parametrize("gated", [False, True])
def test_gated_adam_follows_torch_adam(gated):
    a, b, ref, ours = _adam_pair()
    for _ in range(20):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step(active=torch.tensor(True) if gated else None)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(ours.state[b][key].float(), ref.state[a][key].float(), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("opt_kind", ["gated", "eigenbasis"])
def test_an_inactive_step_changes_nothing(opt_kind):
    """active=False: weights, moments and the step count stay as they were (also for a first step)."""
    p = torch.nn.Parameter(torch.randn(4, 6))
    if opt_kind == "gated":
        opt = GatedAdam([p], lr=1e-2)
    else:
        opt = EigenbasisAdam([p], [IdentityProjector(4, 6)], [torch.nn.Linear(6, 4)], lr=1e-2)
    w0 = p.detach().clone()
    p.grad = torch.randn_like(p)
    opt.step(active=torch.tensor(False))
    assert torch.equal(p, w0) and float(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any()
    opt.step(active=torch.tensor(True))
    state = {k: v.clone() for k, v in opt.state[p].items()}
    w1 = p.detach().clone()
    assert not torch.equal(w1, w0)
    p.grad = torch.randn_like(p)
    opt.step(active=torch.tensor(False))
    assert torch.equal(p, w1) and all(torch.equal(opt.state[p][k], state[k]) for k in state)


def test_eigenbasis_adam_with_identity_is_adam():
    torch.manual_seed(1)
    w = torch.randn(4, 6)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ref = torch.optim.Adam([a], lr=1e-2)
    ours = EigenbasisAdam([b], [IdentityProjector(4, 6)], [torch.nn.Linear(6, 4)], lr=1e-2)
    for _ in range(10):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _host_reads(fn) -> int:
    """Values read back to the host (``aten::_local_scalar_dense`` calls) while ``fn`` runs, except those of
    ``aten::_assert_async`` (``torch.multinomial``'s argument check: a host read on the CPU, a device-side
    assert that does not synchronise on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    n = 0
    for e in prof.events():
        if e.name == "aten::_local_scalar_dense":
            parents, p = [], e.cpu_parent
            while p is not None:
                parents.append(p.name)
                p = p.cpu_parent
            n += "aten::_assert_async" not in parents
    return n


@pytest.mark.parametrize(
    "method,keep",
    [
        ("ft", {}),
        ("crispedit", {"keep_chat": 0, "keep_subject": 0}),
        ("crispedit", {"keep_chat": 3, "keep_subject": 1}),
    ],
    ids=["ft", "crispedit", "crispedit-keep"],
)
def test_the_loop_reads_back_once_per_epoch(method, keep, tiny_lm, iso_cache):
    """Host reads of the loop grow with epochs, not with steps: 4 more epochs of 6 steps each (padded batches of
    one request in several contexts) add at most 2 reads per epoch (the mean loss with the skipped count and the
    preservation term's mean, and the shuffled batch order)."""
    from crispedit.editing.api import edit_factors
    from crispedit.editing.loop import projected_finetune
    from crispedit.editing.registry import get_editor

    model, tok = tiny_lm
    reads, steps = {}, {}
    for epochs in (2, 6):
        config = EditConfig(
            method=method,
            layers="model.layers.{1-2}.mlp.down_proj",
            epochs=epochs,
            lr=1e-3,
            batch_size=2,
            n_cap=4,
            max_len=48,
            contexts="bare,prefix:3",
            stop_loss=0.0,
            **keep,
        )
        editor = get_editor(method)
        layers = editor.select_layers(model, config)
        factors, _ = edit_factors(model, tok, editor, layers, config, progress=False)
        projectors = editor.projectors(layers, factors, config)
        params = editor.trainable(layers)
        saved = {n: p.detach().clone() for n, p in params.items()}
        hist = []
        reads[epochs] = _host_reads(
            lambda hist=hist, layers=layers, params=params, projectors=projectors, config=config: hist.append(
                projected_finetune(model, tok, REQS, layers, params, projectors, config, progress=False, sync_free=True)
            )
        )
        steps[epochs] = hist[0].steps + hist[0].skipped
        assert hist[0].fast_loss
        if keep.get("keep_chat"):  # the term ran and reported each epoch's mean
            assert len(hist[0].extra["keep"]["epoch_term"]) == epochs
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(saved[k])
    per_epoch_steps = (steps[6] - steps[2]) / 4
    assert per_epoch_steps >= 6
    assert reads[6] - reads[2] <= 4 * 2, (reads, steps)  # the epoch's figures and the batch order


def test_skip_rule_on_the_device_matches_the_host_rule(tiny_lm, iso_cache):
    """Batches whose loss is below skip_loss take no step: a threshold above every loss leaves the weights
    untouched and counts every batch skipped; with a threshold in the middle of the losses the device-gated
    rule (sync_free) and the host-read rule take the same steps and end with the same weights."""
    from crispedit.editing.loop import projected_finetune
    from crispedit.editing.registry import get_editor

    model, tok = tiny_lm
    res = edit(
        model,
        tok,
        REQS[:4],
        EditConfig(
            method="ft",
            layers="model.layers.{1-2}.mlp.down_proj",
            epochs=2,
            lr=1e-2,
            batch_size=2,
            skip_loss=100.0,
            stop_loss=1e-9,
            contexts="bare",
        ),
        progress=False,
    )
    assert res.history.steps == 0 and res.history.skipped == 4
    assert all(torch.equal(model.get_parameter(n), w) for n, w in res.original_weights.items())
    config = EditConfig(
        method="ft",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=12,
        lr=2e-2,
        batch_size=1,
        skip_loss=2.0,
        stop_loss=0.0,
        contexts="bare",
    )
    editor = get_editor("ft")
    layers = editor.select_layers(model, config)
    params = editor.trainable(layers)
    start = {n: p.detach().clone() for n, p in params.items()}
    out = {}
    for sync_free in (True, False):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
        hist = projected_finetune(
            model,
            tok,
            REQS,
            layers,
            params,
            editor.projectors(layers, None, config),
            config,
            progress=False,
            sync_free=sync_free,
        )
        out[sync_free] = (hist.steps, hist.skipped, hist.epoch_loss, {n: p.detach().clone() for n, p in params.items()})
    assert out[True][0] == out[False][0] and out[True][1] == out[False][1] and out[True][1] > 0
    assert out[True][2] == pytest.approx(out[False][2], rel=1e-6)
    assert all(torch.allclose(out[True][3][n], out[False][3][n], rtol=1e-6, atol=1e-7) for n in params)


@pytest.mark.parametrize("label_mode", ["sampled", "empirical"])
def test_kfac_collection_reads_back_per_pass_not_per_batch(label_mode, tiny_lm):
    """Sampled labels are drawn where the logits are and the loss rows are taken by index: twice the batches
    (padded ones) read back no more values than once the batches, beyond the plan made on the host."""
    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    base = ["a short text", "another text that is a good deal longer than the first", "third one here", "x y z w"]
    import crispedit.curvature.kfac as kfac_mod

    reads = {}
    for n in (4, 8):
        texts = (base * 2)[:n]
        planned = kfac_mod.lm_batches(tok, texts, max_len=256, batch_size=2, max_padding=None)  # the host's plan
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kfac_mod, "lm_batches", lambda *a, planned=planned, **k: planned)
            reads[n] = _host_reads(
                lambda texts=texts: collect_lm_kfac(
                    model, tok, texts, layers, batch_size=2, max_padding=None, label_mode=label_mode, progress=False
                )
            )
    assert reads[8] - reads[4] == 0, reads


@pytest.mark.parametrize("share", [False, True])
def test_epoch_batches_gather_the_cached_prefix_exactly(tiny_lm64, share):
    """A batch made for one epoch from sequences of several cached batches (another composition, other padding)
    has the plain loss and gradients: the frozen prefix states are gathered per sequence from the cache (per node
    when the batch is packed as prefix trees: then equal up to float64 rounding of other kernel shapes)."""
    from crispedit.editing.contexts import build_training_sequences, parse_contexts
    from crispedit.editing.fastpath import make_loss_fn, plain_loss, prefix_sharing
    from crispedit.editing.sources import epoch_subset, training_batches
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm64
    layers = resolve_layers(model, "model.layers.{2-3}.mlp.down_proj")
    params = {n: m.weight for n, m in layers.items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    seqs = build_training_sequences(tok, REQS, parse_contexts("bare,lead:3"), "auto")
    batches = training_batches(tok, seqs, 4)
    with prefix_sharing(share):
        loss_fn = make_loss_fn(model, params, batches)
    assert loss_fn.fast
    packed = 0
    for epoch in range(3):
        subset = epoch_subset(seqs, 2, 0, epoch)
        assert len(subset) == 2 * len(REQS)
        for b in training_batches(tok, seqs, 3, subset=subset):
            prepared = loss_fn.prepare(b)
            packed += prepared.packed is not None
            lf, lp = loss_fn(prepared), plain_loss(model, b)
            assert torch.allclose(lf, lp, rtol=1e-10)
            gf = torch.autograd.grad(lf, list(params.values()))
            gp = torch.autograd.grad(plain_loss(model, b), list(params.values()))
            if prepared.packed is None:
                assert all(torch.allclose(x, y, rtol=1e-8, atol=1e-12) for x, y in zip(gf, gp))
            else:
                assert all((x - y).norm() <= 1e-7 * y.norm() for x, y in zip(gf, gp))
    assert (packed > 0) == share
    assert epoch_subset(seqs, 2, 0, 1) != epoch_subset(seqs, 2, 0, 2)
    assert epoch_subset(seqs, 2, 0, 1) == epoch_subset(seqs, 2, 0, 1)
    assert epoch_subset(seqs, 9, 0, 1) == list(range(len(seqs)))


def test_context_sample_trains_a_sample_per_epoch(tiny_lm, iso_cache):
    """--context-sample K: an epoch trains K sequences per request; the run is reproducible and the edit learns."""
    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=4,
        lr=1e-2,
        batch_size=4,
        n_cap=4,
        max_len=48,
        contexts="bare,lead:3",
        stop_loss=0.0,
        context_sample=2,
    )
    res = edit(model, tok, REQS, EditConfig(**cfg), progress=False)
    assert res.history.sequences == 2 * len(REQS) and res.history.fast_loss
    assert res.history.epoch_loss[-1] < res.history.epoch_loss[0]
    after = {n: model.get_parameter(n).detach().clone() for n in res.original_weights}
    from crispedit.editing import restore

    restore(model, res.original_weights)
    again = edit(model, tok, REQS, EditConfig(**cfg), progress=False)
    assert again.history.epoch_loss == res.history.epoch_loss
    assert all(torch.equal(model.get_parameter(n), w) for n, w in after.items())
    assert EditConfig(**cfg).to_json()["context_sample"] and EditConfig().to_json()["context_sample"] is None


def test_bf16_precision_trains_float32_weights(tiny_lm, iso_cache):
    """--precision bf16: the forward runs under bfloat16 autocast, yet the trained weights, their gradients and
    the projection stay float32; the edit learns, lands near the float32 run, and the stored config says bf16."""
    from crispedit.editing import restore

    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=6,
        lr=1e-2,
        batch_size=4,
        n_cap=4,
        max_len=48,
        contexts="bare",
        stop_loss=0.0,
        keep_chat=0,  # the edit loss alone: what bf16 changes in the edit's own steps
        keep_subject=0,
    )
    out = {}
    for precision in ("fp32", "bf16"):
        res = edit(model, tok, REQS, EditConfig(**cfg, precision=precision), progress=False)
        out[precision] = (
            res.history.epoch_loss,
            {n: model.get_parameter(n).detach().clone() for n in res.original_weights},
        )
        assert all(model.get_parameter(n).dtype == torch.float32 for n in res.original_weights)
        restore(model, res.original_weights)
    (l32, w32), (l16, w16) = out["fp32"], out["bf16"]
    assert l16[-1] < l16[0] - 1.0 and l16 != l32  # it learned, and the arithmetic differed
    assert l16 == pytest.approx(l32, rel=0.02)  # epoch by epoch, close to the float32 run
    start = res.original_weights
    for n in w32:
        d32, d16 = w32[n] - start[n], w16[n] - start[n]
        assert torch.nn.functional.cosine_similarity(d32.flatten(), d16.flatten(), dim=0) > 0.95
    assert EditConfig(**cfg, precision="bf16").to_json()["precision"] == "bf16"
    assert EditConfig.from_dict(EditConfig(**cfg).to_json()).precision == "fp32"


def test_auto_precision_is_bf16_only_where_native(tiny_lm, iso_cache, monkeypatch, caplog):
    """--precision auto runs as bf16 where the device computes it natively and as fp32 elsewhere (the same losses as
    an fp32 run), and the report says which; an explicit bf16 where it is emulated runs as asked, with a warning."""
    import logging

    import crispedit.editing.loop as loop
    from crispedit.editing import restore
    from crispedit.models import native_bf16

    assert isinstance(native_bf16("cpu"), bool) and native_bf16("meta") is False
    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=3,
        lr=1e-2,
        batch_size=4,
        n_cap=4,
        max_len=48,
        contexts="bare",
        stop_loss=0.0,
    )
    runs = {}
    for precision, native in (("fp32", False), ("auto", False), ("auto", True), ("bf16", True), ("bf16", False)):
        monkeypatch.setattr(loop, "native_bf16", lambda device, native=native: native)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="crispedit.edit"):
            res = edit(model, tok, REQS, EditConfig(**cfg, precision=precision), progress=False)
        restore(model, res.original_weights)
        runs[precision, native] = res.history
        assert ("emulated" in caplog.text) == (precision == "bf16" and not native)
    assert runs["auto", False].epoch_loss == runs["fp32", False].epoch_loss
    assert runs["auto", False].extra["precision"] == "fp32" and "precision" not in runs["fp32", False].extra
    assert runs["auto", True].epoch_loss == runs["bf16", True].epoch_loss != runs["fp32", False].epoch_loss
    assert runs["auto", True].extra["precision"] == runs["bf16", False].extra["precision"] == "bf16"
    assert EditConfig(**cfg, precision="auto").to_json()["precision"] == "auto"


def test_precision_is_checked():
    """An unknown precision is a one-line error naming the field."""
    from crispedit.errors import CrispEditError

    with pytest.raises(CrispEditError, match="precision must be one of fp32, bf16"):
        EditConfig(precision="fp16")


def test_a_killed_edit_resumes_from_its_checkpoint(tiny_lm, iso_cache, tmp_path, monkeypatch):
    """Training killed after its second epoch and run again with the same checkpoint goes on from epoch 3 and
    ends with the weights, losses and step counts of the uninterrupted run; a finished run's checkpoint trains
    nothing again; another run's checkpoint, and a truncated one, are one-line errors that change no weight."""
    import crispedit.editing.checkpoint as ckpt_mod
    from crispedit.editing import restore
    from crispedit.errors import CrispEditError

    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=5,
        lr=1e-2,
        batch_size=3,
        n_cap=4,
        max_len=48,
        contexts="bare,lead:2",
        stop_loss=0.0,
        skip_loss=0.5,
    )
    full = edit(model, tok, REQS, EditConfig(**cfg), progress=False)
    want = {n: model.get_parameter(n).detach().clone() for n in full.original_weights}
    restore(model, full.original_weights)

    ck = tmp_path / "run.safetensors"
    real_save, saves = ckpt_mod.save_checkpoint, []

    def dying_save(*a, **k):
        real_save(*a, **k)
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    monkeypatch.setattr(ckpt_mod, "save_checkpoint", real_save)
    restore(model, full.original_weights)  # what a new process starts from
    res = edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    assert res.history.extra["resumed_at_epoch"] == 2
    assert all(x > 0 for x in res.history.epoch_seconds)  # the killed run's two epochs come from the checkpoint
    assert len(res.history.to_json()["epoch_seconds"]) == 5 == len(full.history.epoch_seconds)
    assert res.history.epoch_loss == full.history.epoch_loss
    assert (res.history.steps, res.history.skipped) == (full.history.steps, full.history.skipped)
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())

    restore(model, full.original_weights)  # finished: the final state comes back, no epoch trains
    again = edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    assert again.history.extra["resumed_at_epoch"] == 5 and again.history.epoch_loss == full.history.epoch_loss
    # the preservation term (crispedit's default) reports every epoch's mean, the killed run's from the checkpoint
    assert len(full.history.extra["keep"]["epoch_term"]) == 5
    assert res.history.extra["keep"] == full.history.extra["keep"] == again.history.extra["keep"]
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())

    restore(model, full.original_weights)
    with pytest.raises(CrispEditError, match="belongs to another run"):
        edit(model, tok, REQS, EditConfig(**{**cfg, "lr": 2e-2}), progress=False, checkpoint=ck)
    ck.write_bytes(ck.read_bytes()[:-100])
    with pytest.raises(CrispEditError, match="training checkpoint file .* truncated"):
        edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    assert all(torch.equal(model.get_parameter(n), w) for n, w in full.original_weights.items())


def test_a_killed_lora_edit_resumes_exactly_with_its_dropout(tiny_lm, iso_cache, tmp_path, monkeypatch):
    """LoRA's adapter init and dropout come from generators seeded with the config's seed (the caller's left as
    they were), and the checkpoint keeps the generators' states: a LoRA edit killed after an epoch and resumed ends
    with the uninterrupted edit's losses and weights, and two edits from the same weights are the same."""
    import crispedit.editing.checkpoint as ckpt_mod
    from crispedit.editing import restore

    model, tok = tiny_lm
    cfg = dict(
        method="lora",
        layers="model.layers.{1-2}.mlp.down_proj",
        epochs=3,
        batch_size=3,
        max_len=48,
        contexts="bare",
        stop_loss=0.0,
    )
    outside = torch.get_rng_state()
    full = edit(model, tok, REQS, EditConfig(**cfg), progress=False)
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's generator untouched
    want = {n: model.get_parameter(n).detach().clone() for n in full.original_weights}
    restore(model, full.original_weights)
    twice = edit(model, tok, REQS, EditConfig(**cfg), progress=False)
    assert twice.history.epoch_loss == full.history.epoch_loss
    restore(model, full.original_weights)

    ck = tmp_path / "lora.safetensors"
    real_save = ckpt_mod.save_checkpoint

    def dying_save(*a, **k):
        real_save(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    monkeypatch.setattr(ckpt_mod, "save_checkpoint", real_save)
    restore(model, full.original_weights)
    torch.manual_seed(1234)  # another process: other generator states
    res = edit(model, tok, REQS, EditConfig(**cfg), progress=False, checkpoint=ck)
    assert res.history.extra["resumed_at_epoch"] == 1 and res.history.epoch_loss == full.history.epoch_loss
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())


def test_a_checkpoint_resumes_under_another_epoch_cap(tiny_lm, iso_cache, tmp_path):
    """The epoch cap is not part of a run's identity: a run stopped by a cap of 2 and resumed under a cap of 4
    ends with the losses, counters and weights of a run capped at 4 from the start; a checkpoint holding more
    epochs than the new cap is refused in one line."""
    from crispedit.editing import restore
    from crispedit.errors import CrispEditError

    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        lr=1e-2,
        batch_size=3,
        n_cap=4,
        max_len=48,
        contexts="bare,lead:2",
        stop_loss=0.0,
        skip_loss=0.5,
    )
    full = edit(model, tok, REQS, EditConfig(**cfg, epochs=4), progress=False)
    want = {n: model.get_parameter(n).detach().clone() for n in full.original_weights}
    restore(model, full.original_weights)

    ck = tmp_path / "run.safetensors"
    short = edit(model, tok, REQS, EditConfig(**cfg, epochs=2), progress=False, checkpoint=ck)
    assert short.history.epoch_loss == full.history.epoch_loss[:2]
    restore(model, full.original_weights)
    res = edit(model, tok, REQS, EditConfig(**cfg, epochs=4), progress=False, checkpoint=ck)
    assert res.history.extra["resumed_at_epoch"] == 2 and res.history.epoch_loss == full.history.epoch_loss
    assert (res.history.steps, res.history.skipped) == (full.history.steps, full.history.skipped)
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())

    restore(model, full.original_weights)
    with pytest.raises(CrispEditError, match="holds 4 trained epochs, more than the cap of 3 epochs"):
        edit(model, tok, REQS, EditConfig(**cfg, epochs=3), progress=False, checkpoint=ck)
    assert all(torch.equal(model.get_parameter(n), w) for n, w in full.original_weights.items())


def test_the_plateau_rule_on_loss_curves():
    """``plateaued``: only near the goal (below twice the stop loss), only after ``epochs`` epochs without a
    ``delta`` relative fall of the best loss, never with the rule off."""
    from crispedit.editing.history import plateaued

    flat = [0.5, 0.1, 0.0121, 0.0120, 0.01199, 0.01198, 0.01197]
    assert plateaued(flat, 0.01, 3, 0.02)  # best 0.01197 of the last 3 is not 2 % below 0.0120
    assert not plateaued(flat, 0.01, 0, 0.02)  # off
    assert not plateaued(flat, 0.01, 6, 0.02)  # fewer than epochs + 1 losses
    assert not plateaued(flat, 0.01, 3, 0.001)  # a 0.25 % fall counts when delta is 0.1 %
    assert not plateaued(flat, 0.005, 3, 0.02)  # 0.0120 is above twice a 0.005 stop loss: still far from the goal
    falling = [0.5, 0.1, 0.05, 0.03, 0.019, 0.015, 0.0125]
    assert not plateaued(falling, 0.01, 3, 0.02)
    bounced = [0.5, 0.012, 0.3, 0.2, 0.015]  # worse than its best: stalled (below the band again)
    assert plateaued(bounced, 0.01, 3, 0.02)


def test_a_stalled_edit_stops_at_its_plateau(tiny_lm, iso_cache, tmp_path):
    """With ``plateau_epochs`` an edit whose loss no longer falls stops after that many epochs, on the trajectory of
    the run without the rule (same losses, same weights at that epoch), reports ``plateaued`` and not
    ``converged``; its final checkpoint trains nothing more when run again; without the rule it runs to the cap.
    A config stored without the fields (before the rule) reads as the rule off."""
    from crispedit.editing import restore

    model, tok = tiny_lm
    cfg = dict(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        lr=1e-7,
        batch_size=3,
        n_cap=4,
        max_len=48,
        contexts="bare",
        skip_loss=0.0,
    )
    probe = edit(model, tok, REQS, EditConfig(**cfg, epochs=1, stop_loss=0.0), progress=False)
    restore(model, probe.original_weights)
    cfg["stop_loss"] = 0.7 * probe.history.epoch_loss[0]  # the loss sits between the stop loss and twice it
    ref = edit(model, tok, REQS, EditConfig(**cfg, epochs=5, plateau_epochs=0), progress=False)
    want = {n: model.get_parameter(n).detach().clone() for n in ref.original_weights}
    assert len(ref.history.epoch_loss) == 5 and not ref.history.plateaued and not ref.history.converged
    assert "plateaued" not in ref.history.to_json()
    assert EditConfig.from_dict(EditConfig(**cfg, plateau_epochs=0).to_json()).plateau_epochs == 0
    restore(model, ref.original_weights)

    ck = tmp_path / "run.safetensors"
    res = edit(model, tok, REQS, EditConfig(**cfg, epochs=50, plateau_epochs=4), progress=False, checkpoint=ck)
    assert res.history.epoch_loss == ref.history.epoch_loss  # stopped after 4 + 1 epochs, on the same path
    assert res.history.plateaued and not res.history.converged and res.history.to_json()["plateaued"] is True
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())
    assert EditConfig(**cfg, plateau_epochs=4).to_json()["plateau_epochs"] == 4
    restore(model, ref.original_weights)
    again = edit(model, tok, REQS, EditConfig(**cfg, epochs=50, plateau_epochs=4), progress=False, checkpoint=ck)
    assert again.history.extra["resumed_at_epoch"] == 5 and again.history.plateaued
    assert all(torch.equal(model.get_parameter(n), w) for n, w in want.items())


@pytest.mark.parametrize("bad", [dict(plateau_epochs=-1), dict(plateau_delta=0.0), dict(plateau_delta=1.0)])
def test_plateau_settings_are_checked(bad):
    from crispedit.errors import CrispEditError

    with pytest.raises(CrispEditError, match="plateau"):
        EditConfig(**bad)


def test_all_greedy_reads_every_target_token(tiny_lm):
    """``all_greedy``: true exactly when every target token of every batch is the model's argmax under teacher
    forcing — labels set to the model's own predictions pass; one changed label in the second batch fails."""
    import contextlib

    from crispedit.data.tokenize import collate
    from crispedit.editing.fastpath import make_loss_fn
    from crispedit.editing.sources import FixedBatches

    model, tok = tiny_lm
    model.train()
    torch.manual_seed(0)
    rows = [(torch.randint(3, len(tok), (n,)).tolist(), 2) for n in (7, 5, 9, 6)]
    batches = [collate(tok, rows[:2]), collate(tok, rows[2:])]
    with torch.no_grad():
        for b in batches:
            own = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.argmax(-1)
            b.labels[:, 1:] = torch.where(b.labels[:, 1:] != -100, own[:, :-1], b.labels[:, 1:])
    params = {n: p for n, p in model.named_parameters() if "layers.1.mlp.down_proj" in n}
    source = FixedBatches(
        ["bare"], batches, make_loss_fn(model, params, batches, enabled=False), contextlib.nullcontext
    )
    assert source.all_greedy() and model.training  # the mode it was in
    last = (batches[1].labels[1] != -100).nonzero()[-1, 0]
    batches[1].labels[1, last] = (batches[1].labels[1, last] + 1) % len(tok)
    assert not source.all_greedy()


def test_the_greedy_stop_rule_ends_an_edit_once_every_target_is_greedy(tiny_lm, iso_cache):
    """``stop_rule="greedy"`` ends the edit at an epoch below ten times the stop loss after which every
    training sequence's target is the greedy continuation — on the trajectory of the loss rule's run (same losses
    up to there), which the tiny model's loss floor keeps from its stop loss until the epoch cap; the report says
    the rule and ``converged``."""
    from crispedit.editing import restore
    from crispedit.editing.contexts import sequences_for
    from crispedit.editing.sources import training_batches

    model, tok = tiny_lm
    cfg = dict(
        method="ft",
        layers="model.layers.{1-2}.mlp.down_proj",
        lr=2e-2,
        batch_size=1,
        n_cap=4,
        max_len=48,
        contexts="bare",
        answer_end="none",
        stop_loss=0.05,  # below the tiny model's loss floor: the loss rule never ends the run
        skip_loss=0.0,
        epochs=60,
        plateau_epochs=0,
    )
    ref = edit(model, tok, REQS[:2], EditConfig(**cfg), progress=False)
    restore(model, ref.original_weights)
    assert not ref.history.converged and len(ref.history.epoch_loss) == 60
    res = edit(model, tok, REQS[:2], EditConfig(**cfg, stop_rule="greedy"), progress=False)
    k = len(res.history.epoch_loss)
    assert res.history.converged and k < 60 and res.history.epoch_loss == ref.history.epoch_loss[:k]
    assert res.history.epoch_loss[-1] < 0.5
    assert res.history.to_json()["stop_rule"] == "greedy" and "stop_rule" not in ref.history.to_json()
    seqs, _ = sequences_for(tok, REQS[:2], res.config, model)
    model.eval()
    with torch.no_grad():
        for b in training_batches(tok, seqs, 1):
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
            gold = b.labels[:, 1:]
            assert torch.equal(logits.argmax(-1)[gold != -100], gold[gold != -100])


def test_the_stop_rule_is_checked():
    from crispedit.errors import CrispEditError

    with pytest.raises(CrispEditError, match="stop rule must be one of loss, greedy"):
        EditConfig(stop_rule="argmax")
