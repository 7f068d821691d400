#!/usr/bin/env bash
# What runs on a lent CUDA GPU, in one go: bench/gpu.py's masks, the CUDA tests, bench/gpu.py's decode, then the
# probes (block masks, the padding guard, the decode step), each within its own time limit, so that one part
# running long cannot take the others' results with it. The limits add up to 580 s, under the device's 600 s a command.
#   OUT=folder bash bench/gpu_run.sh      # 7 files (logs, JSON) land in $OUT; bench/gpu.json was assembled from them
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 -c "import transformers; print('transformers', transformers.__version__)"; } > "$OUT/device.txt" 2>&1
timeout "${MASKS_S:-130}" python3 bench/gpu.py --part masks --out "$OUT/gpu_masks.json" > "$OUT/masks.log" 2>&1
echo "masks: exit $?" >> "$OUT/device.txt"
timeout "${TESTS_S:-120}" python3 -m pytest --noconftest -o addopts='' -q -p no:cacheprovider --durations=8 \
    tests/test_cuda.py > "$OUT/tests.log" 2>&1
echo "tests: exit $?" >> "$OUT/device.txt"
timeout "${DECODE_S:-150}" python3 bench/gpu.py --part decode --out "$OUT/gpu_decode.json" > "$OUT/decode.log" 2>&1
echo "decode: exit $?" >> "$OUT/device.txt"
: > "$OUT/probes.log"                                  # a rerun into the same $OUT starts it afresh
for probe_s in blockmask_probe:110 guard_probe:20 decode_probe:50; do  # compiling: 4 to 24 s a shape
  probe=${probe_s%:*}
  { echo "== $probe"; timeout "${probe_s#*:}" python3 "bench/$probe.py"; } >> "$OUT/probes.log" 2>&1
  echo "$probe: exit $?" >> "$OUT/device.txt"
done
cat "$OUT/device.txt"; tail -3 "$OUT/tests.log"
