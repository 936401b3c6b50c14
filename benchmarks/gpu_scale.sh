#!/usr/bin/env bash
# The GPU scaling marks in one script, for a session lent a GPU machine (the device tool runs it in the
# repository root; results land in $OUT). Random-init weights of the real shapes: timings only.
#   bash benchmarks/gpu_scale.sh            # everything (at most 10 minutes: each case under a timeout)
#   QUICK=1 bash benchmarks/gpu_scale.sh    # a smoke run (small shapes) to check the script itself
#   SHORT=1 bash benchmarks/gpu_scale.sh    # about 3 minutes: TF32 leak, token batches, a profiled epoch
#   WALL=1 bash benchmarks/gpu_scale.sh     # about 7 minutes: the Llama-3-8B-shaped wall mark alone (XXH3 fingerprint,
#                                           # the TF32 form rule), with a longer budget than the full run gives it
#   HOST=1 bash benchmarks/gpu_scale.sh     # about 5 minutes: where the host-bound K-FAC batch and step go
#                                           # (profiled K-FAC at 8 and 64 texts a batch; eager / compiled / CUDA-graph blocks)
# The device image may lack xxhash: see benchmarks/gpu_setup.sh for fetching its wheel beforehand.
set -uo pipefail
OUT=${OUT:-runs/gpu_scale}
. benchmarks/gpu_setup.sh
if [ "${QUICK:-0}" = 1 ]; then
  $PY benchmarks/bench_scale.py --random-init smollm2 --blocks 4 --layers 'model.layers.{1-3}.mlp.down_proj' \
      --synthetic 64 --epochs 2 --n-cap 8 --device cuda --dtype bfloat16 --json "$OUT/quick.json" 2>&1 | tee "$OUT/quick.txt"
  exit 0
fi
if [ "${SHORT:-0}" = 1 ]; then  # a follow-up in about 3 minutes: leak test, token batches fp32/tf32, profile, K-FAC
  timeout 45 $PY -m pytest -q -s -p no:cacheprovider tests/curvature/test_rotation_precision.py -k cuda 2>&1 | tee "$OUT/tf32_leak.txt"
  # the first entry warms the process up (cuBLAS, kernels); the ratios are against the last
  timeout 100 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 2 --device cuda \
      --dtype bfloat16 --batch-tokens 16384 --n-cap 512 --no-profile --method crispedit,crispedit:tf32,crispedit \
      --json "$OUT/smollm2_1000_tokens_b.json" 2>&1 | tee "$OUT/smollm2_1000_tokens_b.txt"
  timeout 50 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 100 --epochs 1 --device cuda \
      --dtype bfloat16 --json "$OUT/smollm2_100_profile.json" 2>&1 | tee "$OUT/smollm2_100_profile.txt"
  exit 0
fi
if [ "${WALL:-0}" = 1 ]; then
  timeout ${T_8B:-480} $PY benchmarks/bench_scale.py --random-init llama3-8b --synthetic 3000 --contexts bare --epochs 25 \
      --device cuda --dtype bfloat16 --n-cap 64 --no-profile --projection-precision tf32 \
      --json "$OUT/llama3_8b_3000_wall.json" 2>&1 | tee "$OUT/llama3_8b_3000_wall.txt"
  exit 0
fi
if [ "${HOST:-0}" = 1 ]; then
  # the CUDA-only tests first (TF32 forcing, float32 eigh), then K-FAC under the profiler at two batch sizes
  timeout 60 $PY -m pytest -q -s -p no:cacheprovider tests/curvature/test_rotation_precision.py tests/curvature/test_projection.py tests/experiments/test_curvature_study.py -k cuda 2>&1 | tail -5 | tee "$OUT/cuda_tests.txt"
  for kb in 8 64; do
    timeout 80 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 64 --epochs 1 --device cuda \
        --dtype bfloat16 --n-cap 512 --kfac-batch-size $kb --profile-kfac --no-profile \
        --json "$OUT/kfac_profile_b$kb.json" 2>&1 | tee "$OUT/kfac_profile_b$kb.txt"
  done
  # 1 000 edits, default contexts, 32-sequence batches: eager against compiled blocks against CUDA graphs, and
  # without the shared-prefix packing (noshare)
  timeout 240 $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 1 --device cuda \
      --dtype bfloat16 --n-cap 64 --profile-requests 32 \
      --method crispedit,crispedit:noshare,crispedit:compile,crispedit:graphs,crispedit \
      --json "$OUT/smollm2_1000_compile.json" 2>&1 | tee "$OUT/smollm2_1000_compile.txt"
  exit 0
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# the projection's TF32 GEMMs: what leaks into the masked subspace at SmolLM2's and Llama-3-8B's down_proj shapes
timeout 60 $PY -m pytest -q -s -p no:cacheprovider tests/curvature/test_rotation_precision.py -k cuda 2>&1 | tee "$OUT/tf32_leak.txt"
# SmolLM2-shaped, 1 000 edits, default contexts: s/epoch (mark <= 3 s), K-FAC tokens/s (mark >= 20 000), host syncs
timeout ${T_SMOL:-130} $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 2 --device cuda \
    --dtype bfloat16 --json "$OUT/smollm2_1000.json" 2>&1 | tee "$OUT/smollm2_1000.txt"
# Llama-3-8B-shaped, 32 blocks, layers 19-23, 3 000 edits, bare context, 25 epochs (mark <= 6 min wall, aim 2);
# the projection's GEMMs in TF32 (full form: the leak bound above)
timeout ${T_8B:-320} $PY benchmarks/bench_scale.py --random-init llama3-8b --synthetic 3000 --contexts bare --epochs 25 \
    --device cuda --dtype bfloat16 --n-cap 64 --no-profile --projection-precision tf32 \
    --json "$OUT/llama3_8b_3000.json" 2>&1 | tee "$OUT/llama3_8b_3000.txt"
# SmolLM2-shaped again, batches packed to 16 384 tokens, fp32 against TF32 projection in one run
timeout ${T_TOK:-70} $PY benchmarks/bench_scale.py --random-init smollm2 --synthetic 1000 --epochs 2 --device cuda \
    --dtype bfloat16 --batch-tokens 16384 --no-profile --method crispedit:tf32,crispedit \
    --json "$OUT/smollm2_1000_tokens.json" 2>&1 | tee "$OUT/smollm2_1000_tokens.txt"
