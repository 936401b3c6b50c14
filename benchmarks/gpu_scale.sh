#!/usr/bin/env bash
# The GPU marks of issue 37 in one script, for a session lent a GPU machine (the device tool runs it in the
# repository root; results land in $OUT). Random-init weights of the real shapes: timings only.
#   bash benchmarks/gpu_scale.sh            # everything (about 10 minutes on one H100)
#   QUICK=1 bash benchmarks/gpu_scale.sh    # a smoke run (small shapes) to check the script itself
set -uo pipefail
OUT=${OUT:-runs/gpu_scale}
mkdir -p "$OUT"
PY=${PY:-python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
if [ "${QUICK:-0}" = 1 ]; then
  $PY benchmarks/bench_scale.py --random-init smollm2 --blocks 4 --layers 'model.layers.{1-3}.mlp.down_proj' \
      --synthetic 64 --epochs 2 --n-cap 8 --device cuda --dtype bfloat16 --json "$OUT/quick.json" 2>&1 | tee "$OUT/quick.txt"
  exit 0
fi
# SmolLM2-shaped, 1 000 edits, default contexts: s/epoch (mark <= 3 s), K-FAC tokens/s (mark >= 20 000)
timeout 240 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 2 --device cuda \
    --dtype bfloat16 --json "$OUT/smollm2_1000.json" 2>&1 | tee "$OUT/smollm2_1000.txt"
timeout 180 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 2 --device cuda \
    --dtype bfloat16 --batch-tokens 16384 --no-profile --json "$OUT/smollm2_1000_tokens.json" 2>&1 | tee "$OUT/smollm2_1000_tokens.txt"
# Llama-3-8B-shaped, 32 blocks, layers 19-23, 3 000 edits, bare context, 25 epochs (mark <= 6 min wall, aim 2)
timeout 420 $PY benchmarks/bench_scale.py --random-init llama3-8b --synthetic 3000 --contexts bare --epochs 25 \
    --device cuda --dtype bfloat16 --n-cap 64 --no-profile --json "$OUT/llama3_8b_3000.json" 2>&1 | tee "$OUT/llama3_8b_3000.txt"
