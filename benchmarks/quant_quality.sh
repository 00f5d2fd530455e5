#!/usr/bin/env bash
# The quality table of docs/quantization.md: SmolLM2-135M (the embedded default) quantized by each method,
# calibrated on Shakespeare comedies, scored on Hamlet (first $TOKENS tokens) and on Daodejing 1-10.
# CPU only. Usage, from the repository root:
#   benchmarks/quant_quality.sh OUT_DIR   (AUTOAWQ_PY=/path/to/autoawq-venv/bin/python for that row)
#   benchmarks/quant_quality.sh --cpu-smoke OUT_DIR   (the FP8 W8A8 row only, Daodejing's first 64 tokens)
#   ROWS="awq-w4-g64-cpu gptq-w4-g64-cpu" benchmarks/quant_quality.sh OUT_DIR   (only the rows named)
# Every row is calibrated on SAMPLES x SEQ_LEN tokens (the table's 32 x 512) except the *-cpu rows, which take
# `vserve quantize`'s CPU defaults (no --num-samples / --seq-len).
set -euo pipefail
SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
OUT=${1:?usage: $0 [--cpu-smoke] OUT_DIR}
PY=${PY:-.venv/bin/python}
TOKENS=${TOKENS:-8192}
SAMPLES=${SAMPLES:-32}
SEQ_LEN=512
ZH=benchmarks/data/daodejing_1-10.txt
DATA=(shakespeare "$ZH")
if [ "$SMOKE" = 1 ]; then TOKENS=64 SAMPLES=2 SEQ_LEN=64 DATA=("$ZH"); fi
mkdir -p "$OUT"
export VSERVE_NO_PROGRESS=1
Q="-m vserve.cli.main quantize --overwrite"
BASE=$($PY -c "from vserve.ops.assets import default_model_path; print(default_model_path())")

want() {  # want NAME: the row is asked for (every row when ROWS is empty)
  [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" $1 "* ]]
}

ppl() {  # ppl NAME FOLDER [extra bench flags]
  local name=$1 folder=$2; shift 2
  want "$name" || return 0
  for data in "${DATA[@]}"; do
    $PY -m vserve.cli.main bench perplexity "$folder" --data "$data" --max-tokens "$TOKENS" --json "$@" |
      $PY -c "import json,sys; r=json.load(sys.stdin); r['row']='$name'; print(json.dumps(r))" >> "$OUT/results.jsonl"
  done
}

quant() {  # quant NAME [quantize flags]
  local name=$1; shift
  want "$name" || return 0
  local calib="--num-samples $SAMPLES --seq-len $SEQ_LEN"
  if [[ $name == *-cpu ]]; then calib=""; fi
  local start=$SECONDS
  $PY $Q $calib -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "{\"row\": \"$name\", \"quantize_s\": $((SECONDS - start))}" >> "$OUT/results.jsonl"
}

quant fp8-w8a8 --method fp8 && ppl fp8-w8a8 "$OUT/fp8-w8a8"
if [ "$SMOKE" = 1 ]; then exit 0; fi
ppl fp32 "$BASE" --dtype float32
quant rtn-w4-g64 --method rtn --group-size 64 && ppl rtn-w4-g64 "$OUT/rtn-w4-g64"
quant fp8-w8a16 --method fp8 --weight-only && ppl fp8-w8a16 "$OUT/fp8-w8a16"
quant awq-w4-g64 --method awq --group-size 64 && ppl awq-w4-g64 "$OUT/awq-w4-g64"
quant gptq-w4-g64 --method gptq --group-size 64 && ppl gptq-w4-g64 "$OUT/gptq-w4-g64"
quant gptq-w4-g64-desc --method gptq --group-size 64 --desc-act && ppl gptq-w4-g64-desc "$OUT/gptq-w4-g64-desc"
# issue #31: AWQ and GPTQ with the CPU defaults of `vserve quantize` (fewer calibration tokens, said in its output)
quant awq-w4-g64-cpu --method awq --group-size 64 && ppl awq-w4-g64-cpu "$OUT/awq-w4-g64-cpu"
quant gptq-w4-g64-cpu --method gptq --group-size 64 && ppl gptq-w4-g64-cpu "$OUT/gptq-w4-g64-cpu"
quant int8-w8a8-cpu --method int8 && ppl int8-w8a8-cpu "$OUT/int8-w8a8-cpu"
quant int8-w8a8-sq --method int8 --smoothquant-alpha 0.5 && ppl int8-w8a8-sq "$OUT/int8-w8a8-sq"
quant fp8-w8a8-gptq --method fp8 --gptq && ppl fp8-w8a8-gptq "$OUT/fp8-w8a8-gptq"
quant int8-w8a8-sq-gptq --method int8 --smoothquant-alpha 0.5 --gptq && ppl int8-w8a8-sq-gptq "$OUT/int8-w8a8-sq-gptq"
# SmoothQuant's alpha searched per group (int8's default; opt-in for fp8)
quant int8-w8a8-sq-auto --method int8 --smoothquant-alpha auto && ppl int8-w8a8-sq-auto "$OUT/int8-w8a8-sq-auto"
quant int8-w8a8-sq-auto-gptq --method int8 --smoothquant-alpha auto --gptq
ppl int8-w8a8-sq-auto-gptq "$OUT/int8-w8a8-sq-auto-gptq"
quant fp8-w8a8-sq-auto --method fp8 --smoothquant-alpha auto && ppl fp8-w8a8-sq-auto "$OUT/fp8-w8a8-sq-auto"
quant fp8-w8a8-sq-auto-gptq --method fp8 --smoothquant-alpha auto --gptq
ppl fp8-w8a8-sq-auto-gptq "$OUT/fp8-w8a8-sq-auto-gptq"
if [ -n "${AUTOAWQ_PY:-}" ]; then
  PY=$AUTOAWQ_PY quant autoawq-w4-g64 --method awq --backend autoawq --group-size 64
  ppl autoawq-w4-g64 "$OUT/autoawq-w4-g64"
fi
ppl bf16 "$BASE" --dtype bfloat16
