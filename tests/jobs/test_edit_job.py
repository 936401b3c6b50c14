"""EditJob, the one edit-then-measure step under ``crispedit edit``, compare, the demo and the playground: a failed
edit (an exception, or weights that are no longer finite) leaves the model bit for bit as it was, ``run`` measures
what the edit did, and ``restore_after`` hands the base back."""

from __future__ import annotations

import pytest
import torch

import crispedit.pipeline as pipeline
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.errors import CrispEditError
from crispedit.pipeline import EditJob, Measures
from crispedit.weights import weight_fingerprint

REQS = [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}", subject=f"club {i}") for i in range(2)]
CONFIG = EditConfig(
    method="ft",
    layers="model.layers.{1-2}.mlp.down_proj",
    epochs=3,
    lr=1e-2,
    batch_size=4,
    n_cap=4,
    max_len=32,
    contexts="bare",
    keep_chat=0,
    keep_subject=0,
)
QUICK = Measures(wild=(), assistant=False, kl_texts=2)


def test_run_measures_the_edit_and_can_hand_the_base_back(tiny_lm, iso_cache):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    result, ev = EditJob(model, tok, REQS, CONFIG, QUICK, progress=False).run()
    assert weight_fingerprint(model) != fp and ev["summary"]["kl_drift"] > 0 and "wild" not in ev
    assert sorted(result.original_weights) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.2.mlp.down_proj.weight",
    ]
    pipeline.restore(model, result.original_weights)
    assert weight_fingerprint(model) == fp
    _, ev2 = EditJob(model, tok, REQS, CONFIG, QUICK, progress=False).run(restore_after=True)
    assert weight_fingerprint(model) == fp and ev2["summary"]["kl_drift"] == ev["summary"]["kl_drift"]


@pytest.mark.parametrize("failure", ["exception", "non-finite"])
def test_a_failed_edit_leaves_the_model_as_it_was(tiny_lm, iso_cache, monkeypatch, failure):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    real = pipeline.edit

    def failing(model, *args, **kwargs):
        result = real(model, *args, **kwargs)  # the weights have changed ...
        if failure == "exception":
            raise KeyboardInterrupt  # ... and the process is stopped
        with torch.no_grad():
            model.get_parameter("model.layers.2.mlp.down_proj.weight")[0, 0] = float("inf")
        return result

    monkeypatch.setattr(pipeline, "edit", failing)
    job = EditJob(model, tok, REQS, CONFIG, QUICK, progress=False)
    if failure == "exception":
        with pytest.raises(KeyboardInterrupt):
            job.run()
    else:
        with pytest.raises(CrispEditError, match="^the ft edit .*non-finite"):
            job.run()
    assert weight_fingerprint(model) == fp
