#!/usr/bin/env bash
# The split edit (--shard: the decoder blocks under FSDP2 across torchrun's processes, NCCL) on one node's GPUs,
# with random-init weights of real shapes: each process's peak GPU memory during a real edit (K-FAC collected,
# a few epochs) beside what benchmarks/shard_memory.py's calculator predicts for it. For a machine with GPUs (the
# device tool runs it in the repository root; results land in $OUT).
#   bash benchmarks/gpu_shard.sh              # every GPU of the node: the Llama-3-8B shape, then the Llama-3-70B
#                                             # shape cut to 12 blocks (each under a timeout)
#   QUICK=1 bash benchmarks/gpu_shard.sh      # the small shape: a smoke run of the script itself
#   NGPU=2 bash benchmarks/gpu_shard.sh       # on 2 of the GPUs
# With one GPU there is nothing to split across: the script then measures the unsplit edit (N = 1) against the
# calculator. Every process builds the whole random model on the host before the split: host memory must hold
# the model's bytes once per process (Llama-3-8B in bfloat16: 16 GB each).
# The device image may lack xxhash: see benchmarks/gpu_setup.sh for fetching its wheel beforehand.
set -uo pipefail
OUT=${OUT:-runs/gpu_shard}
. benchmarks/gpu_setup.sh
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
SHARD=--shard
if [ "$NGPU" -lt 2 ]; then
  SHARD=""
  echo "one GPU: measuring the unsplit edit (N = 1) against the calculator" | tee -a "$OUT/device.txt"
fi

measure() {  # NAME TIMEOUT_S ARGS...: one edit under torchrun, its JSON and the printed lines in $OUT
  local name=$1 limit=$2
  shift 2
  timeout "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" benchmarks/shard_memory.py \
      measure $SHARD --device cuda "$@" --json "$OUT/$name.json" 2>&1 | grep -v Warning | tail -20 | tee "$OUT/$name.txt"
}

if [ "${QUICK:-0}" = 1 ]; then
  measure small_quick 180 --shape small --dtype bfloat16
  exit 0
fi
measure llama3_8b 300 --shape llama3-8b --dtype bfloat16 --layers 'model.layers.{19-23}.mlp.down_proj' --n-cap 64
measure llama3_70b_12blocks 300 --shape llama3-70b --blocks 12 --dtype bfloat16 \
    --layers 'model.layers.{6-10}.mlp.down_proj' --n-cap 32
$PY benchmarks/shard_memory.py table --json "$OUT/table.json" | tee "$OUT/table.txt"
