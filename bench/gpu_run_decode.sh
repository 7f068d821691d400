#!/usr/bin/env bash
# What runs on a lent CUDA GPU for issue 32's open figures, in one go, each part within its own time limit (they add
# up to 550 s, under the device's 600 s a command; each JSON is written as its rows are measured):
#   the stacked products' and the documents' CUDA tests; bench/gpu_decode.py --part stacked (separate against
#   stacked products, the same compiled step, GPT-2 small and the Llama-1B shape); --part decode for the Llama-2-7B
#   shape (tokens/s against the bandwidth limit, stacked as generate runs, and transformers' static cache); and
#   bench/gpu_packed.py --part documents (a layer on packed documents against varlen, the runs found with one wait).
#   OUT=folder bash bench/gpu_run_decode.sh     # logs and JSON land in $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 -c "import transformers; print('transformers', transformers.__version__)"; } > "$OUT/device.txt" 2>&1
timeout "${TESTS_S:-80}" python3 -m pytest --noconftest -o addopts='' -q -p no:cacheprovider -k 'stacked or documents or padding or unpad' \
    tests/test_cuda.py > "$OUT/tests.log" 2>&1
echo "tests: exit $?" >> "$OUT/device.txt"
timeout "${STACKED_S:-190}" python3 bench/gpu_decode.py --part stacked --shapes 'GPT-2 small,Llama-1B shape' \
    --out "$OUT/gpu_stacked.json" > "$OUT/stacked.log" 2>&1
echo "stacked: exit $?" >> "$OUT/device.txt"
timeout "${DECODE_S:-180}" python3 bench/gpu_decode.py --part decode --shapes 'Llama-2-7B shape' \
    --out "$OUT/gpu_decode_7b.json" > "$OUT/decode_7b.log" 2>&1
echo "decode 7B: exit $?" >> "$OUT/device.txt"
timeout "${PACKED_S:-100}" python3 bench/gpu_packed.py --part documents --out "$OUT/gpu_packed.json" \
    > "$OUT/packed.log" 2>&1
echo "packed: exit $?" >> "$OUT/device.txt"
cat "$OUT/device.txt"; tail -3 "$OUT/tests.log"; grep -h "tokens/s\|stacked / separate\|error" "$OUT"/*.log | head -20
