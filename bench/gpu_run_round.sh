#!/usr/bin/env bash
# What runs on a lent CUDA GPU for the decode targets and this round's attention, in one go, each part within its
# own time limit (they add up to 540 s, under the device's 600 s a command; each JSON is written as its rows are
# measured):
#   bench/gpu_decode.py --part decode: GPT-2 small, the Llama-1B and Llama-2-7B shapes, tokens/s against the
#     bandwidth limit, beside transformers' compiled static cache on the same weights;
#   bench/gpu_packed.py --part documents: a layer on packed documents against varlen;
#   bench/gpu_round.py: the chunked gated delta rule against flash-linear-attention, sinks through the log-sum-exp,
#     absorbed MLA decoding at 32k cached tokens, the paged cache against the contiguous one. flash-linear-attention is not on the GPU machine's image: its
#     fla-core wheel travels in .whl/ (pip download --no-deps fla-core==0.6.0) and is installed for this part only.
#   OUT=folder bash bench/gpu_run_round.sh     # logs and JSON land in $OUT
# To measure a part again alone: DECODE_S=0 or PACKED_S=0 skip those; ROUND_PARTS=paged,sinks,mla picks gpu_round's parts;
# DECODE_ARGS='--tuned' is passed to gpu_decode.py, DECODE_SHAPES='Llama-1B shape,...' as its --shapes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  python3 -c "import transformers; print('transformers', transformers.__version__)"; date -u; } > "$OUT/device.txt" 2>&1
if [ "${DECODE_S:-350}" != 0 ]; then
  timeout "${DECODE_S:-350}" python3 bench/gpu_decode.py --part decode ${DECODE_ARGS:-} ${DECODE_SHAPES:+--shapes "$DECODE_SHAPES"} \
      --out "$OUT/gpu_decode.json" \
      > "$OUT/decode.log" 2>&1
  echo "decode: exit $?" >> "$OUT/device.txt"
fi
if [ "${PACKED_S:-80}" != 0 ]; then
  timeout "${PACKED_S:-80}" python3 bench/gpu_packed.py --part documents --out "$OUT/gpu_packed.json" \
      > "$OUT/packed.log" 2>&1
  echo "packed: exit $?" >> "$OUT/device.txt"
fi
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fla_core-*.whl \
    >> "$OUT/device.txt" 2>&1
fi
PYTHONPATH=$PWD:/tmp/site timeout "${ROUND_S:-110}" python3 bench/gpu_round.py --part "${ROUND_PARTS:-linear,paged,sinks,mla}" \
    --out "$OUT/gpu_round.json" > "$OUT/round.log" 2>&1
echo "round: exit $?" >> "$OUT/device.txt"
cat "$OUT/device.txt"; grep -h "tokens/s\|over_varlen\|linear \|sinks \|mla \|rror" "$OUT"/*.log | cut -c1-400 | head -40
