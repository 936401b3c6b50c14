# Sourced by the GPU scripts (gpu_scale.sh, gpu_shard.sh) after they set OUT: the Python to run ($PY), the checkout's
# src/ on its path, xxhash from gpu_wheels/ when the device image lacks it, and the device's name and memory in
# $OUT/device.txt.
# The device image may lack xxhash (weight fingerprints) and cannot reach PyPI: fetch its wheel here first, untracked
# so that it travels with the checkout:
#   pip download xxhash --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps -d gpu_wheels
mkdir -p "$OUT"
PY=${PY:-python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import xxhash" 2>/dev/null || $PY -m pip install -q --no-index --find-links gpu_wheels xxhash \
  || { echo "xxhash is missing and gpu_wheels/ holds no wheel for it (see benchmarks/gpu_setup.sh)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
