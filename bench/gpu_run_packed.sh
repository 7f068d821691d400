#!/usr/bin/env bash
# What runs on a lent CUDA GPU for packed documents, padding-free training and the host time of a decode step, in
# one go, each part within its own time limit (they add up to 540 s, under the device's 600 s a command):
#   the CUDA tests (varlen on documents, unpad), bench/gpu_packed.py, bench/families.py on the GPU in bfloat16,
#   bench/gpu_decode.py --part graphs.
#   OUT=folder bash bench/gpu_run_packed.sh     # logs and JSON land in $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 -c "import transformers; print('transformers', transformers.__version__)"; } > "$OUT/device.txt" 2>&1
timeout "${TESTS_S:-110}" python3 -m pytest --noconftest -o addopts='' -q -p no:cacheprovider --durations=5 \
    tests/test_cuda.py > "$OUT/tests.log" 2>&1
echo "tests: exit $?" >> "$OUT/device.txt"
timeout "${PACKED_S:-130}" python3 bench/gpu_packed.py --out "$OUT/gpu_packed.json" > "$OUT/packed.log" 2>&1
echo "packed: exit $?" >> "$OUT/device.txt"
timeout "${FAMILIES_S:-140}" python3 bench/families.py --device cuda --dtype bfloat16 --out "$OUT/families_gpu.json" \
    > "$OUT/families.log" 2>&1
echo "families: exit $?" >> "$OUT/device.txt"
timeout "${GRAPHS_S:-160}" python3 bench/gpu_decode.py --part graphs --out "$OUT/gpu_graphs.json" > "$OUT/graphs.log" 2>&1
echo "graphs: exit $?" >> "$OUT/device.txt"
cat "$OUT/device.txt"; tail -3 "$OUT/tests.log"; grep -h "over\|error" "$OUT/packed.log" | head -20
