"""One process of the 2-process K-FAC test (launched by ``torchrun`` from ``tests/curvature/test_distributed.py``; not a
test module itself).

    torchrun --standalone --nproc-per-node 2 tests/curvature/dist_kfac_worker.py MODEL_DIR TEXTS_JSON OUT_DIR

Joins a gloo process group from torchrun's environment, loads the tiny model in float64, collects float64
K-FAC factors for every case of :data:`CASES` with the corpus sharded across the processes, and writes
``OUT_DIR/rank{r}_{case}.safetensors`` (A and S per layer) plus the token count in the metadata.
"""

from __future__ import annotations

import json
import os
import sys

import torch

CASES = {
    # name: (number of texts, batch size, label mode): 3 batches over 2 processes (uneven shards), and one
    # batch (the second process sees nothing and contributes zero sums)
    "uneven": (5, 2, "sampled"),
    "one_batch": (2, 2, "empirical"),
}
LAYERS = "model.layers.{1-2}.mlp.down_proj"


def collect(model, tok, texts: list[str], case: str):
    """Float64 K-FAC factors of ``case`` (see :data:`CASES`) on ``model``; sharded when a group is set up."""
    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.layers import resolve_layers

    n, batch, mode = CASES[case]
    return collect_lm_kfac(
        model,
        tok,
        texts[:n],
        resolve_layers(model, LAYERS),
        max_len=24,
        batch_size=batch,
        label_mode=mode,
        seed=3,
        stat_dtype=torch.float64,
        out_dtype=torch.float64,
        progress=False,
    )


def main() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from crispedit.models import load_model

    torch.set_num_threads(1)
    model_dir, texts_json, out = sys.argv[1:4]
    texts = json.loads(open(texts_json).read())
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, tok = load_model(model_dir, dtype=torch.float64)
        for case in CASES:
            f = collect(model, tok, texts, case)
            save_file(
                f.to_tensors(),
                os.path.join(out, f"rank{rank}_{case}.safetensors"),
                metadata={"n_tokens": str(f.n_tokens), "world_size": str(dist.get_world_size())},
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
