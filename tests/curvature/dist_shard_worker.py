"""One process of the sharded-model tests (launched by ``torchrun`` from ``tests/curvature/test_sharding.py``; not a
test module itself).

    torchrun --standalone --nproc-per-node 2 tests/curvature/dist_shard_worker.py MODE MODEL_DIR EDITS_JSON OUT_DIR

Joins a gloo process group, loads the tiny model in float64 and splits its decoder blocks across the processes
(:func:`crispedit.distributed.shard_model`). ``MODE``:

* ``kfac`` — every block split, the edit layers' weights too: float64 K-FAC factors of every case of
  :data:`dist_kfac_worker.CASES`, written to ``OUT_DIR/rank{r}_{case}.safetensors``.
* ``edit`` — split for an edit (:func:`crispedit.editing.shard_for_edit`, the edited weights whole) and edited
  with :func:`edit_config`, resuming from ``OUT_DIR/ckpt.safetensors`` when it holds this run; the edited weights
  go to ``OUT_DIR/rank{r}_edit.safetensors``, the training history and the bytes of the weights the process
  stores (its slices and the whole parameters) to ``OUT_DIR/rank{r}_edit.json``.
* ``kill`` — as ``edit``, but every process exits (status 3) right after the checkpoint of epoch
  :data:`KILL_AFTER` is written: a run killed there.
"""

from __future__ import annotations

import json
import os
import sys

import torch

KILL_AFTER = 2  # epochs


def edit_config():
    """The edit both the split run and the one-process reference run: 5 epochs, the 15 training sequences in
    batches of at most 4 of one context (the 5 bare ones as 4 + 1: a batch the second process has no row of), and
    a skip loss the later epochs' batches fall below (skipped batches as well as steps), and the preservation
    term on the answers to 3 chat prompts and one question per edited subject (every process runs its forwards)."""
    from crispedit.editing import EditConfig

    return EditConfig(
        layers="model.layers.{1-2}.mlp.down_proj",
        n_cap=4,
        max_len=32,
        epochs=5,
        lr=1e-2,
        batch_size=4,
        contexts="bare,prefix:2",
        skip_loss=5.0,
        kfac_batch_size=3,
        keep_chat=3,
        keep_subject=1,
    )


def _edit(model, tok, edits_json: str, out: str, kill: bool) -> None:
    """Split ``model`` for the edit of :func:`edit_config`, edit it (checkpoint in ``out``) and write this
    process's result; with ``kill``, exit after epoch :data:`KILL_AFTER`'s checkpoint."""
    from safetensors.torch import save_file

    from crispedit.data import load_edits
    from crispedit.distributed import rank
    from crispedit.editing import edit, shard_for_edit
    from crispedit.editing.checkpoint import LoopCheckpoint

    if kill:
        save = LoopCheckpoint.save_if_due

        def save_then_die(self, state, start, final):
            save(self, state, start, final)
            if state.epochs == KILL_AFTER:
                os._exit(3)  # no clean-up, as a kill

        LoopCheckpoint.save_if_due = save_then_die
    config = edit_config()
    fingerprint = shard_for_edit(model, config)
    from torch.distributed.tensor import DTensor

    held = sum((p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in model.parameters())
    res = edit(
        model,
        tok,
        load_edits(edits_json),
        config,
        cache_root=os.path.join(out, "cache"),
        progress=False,
        checkpoint=os.path.join(out, "ckpt.safetensors"),
        fingerprint=fingerprint,
    )
    r = rank()
    save_file(
        {n: p.detach().contiguous() for n, p in res.original_weights.items()},
        os.path.join(out, f"rank{r}_base.safetensors"),
    )
    from crispedit.weights import parameter

    save_file(
        {n: parameter(model, n).detach().contiguous() for n in res.original_weights},
        os.path.join(out, f"rank{r}_edit.safetensors"),
    )
    with open(os.path.join(out, f"rank{r}_edit.json"), "w") as fh:
        json.dump({**res.history.to_json(), "held_weight_bytes": held}, fh)


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from crispedit.distributed import shard_model
    from crispedit.models import load_model

    torch.set_num_threads(1)
    mode, model_dir, edits_json, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        if mode == "kfac":
            from dist_kfac_worker import CASES, collect

            texts = json.loads(open(edits_json).read())
            for case in CASES:
                model, tok = load_model(model_dir, dtype=torch.float64)
                shard_model(model, keep=())
                f = collect(model, tok, texts, case)
                save_file(
                    f.to_tensors(),
                    os.path.join(out, f"rank{rank}_{case}.safetensors"),
                    metadata={"n_tokens": str(f.n_tokens)},
                )
        else:
            model, tok = load_model(model_dir, dtype=torch.float64)
            _edit(model, tok, edits_json, out, kill=mode == "kill")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
