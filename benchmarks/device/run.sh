#!/bin/bash
# One device call's benchmarks, results under $OUT (the device tool's folder). MODE:
#   host  the 0.5B step's host time by torch op (engine_host_profile --torch-profile), then ROWS (default: issue
#         #24's qwen05b_512 and start-up rows)
#   lora  the LoRA kernels' bf16 check and bench (gpu_check's check_lora / bench_lora), then ROWS (default: #28's,
#         the 0.8x goal's pair first)
#   sv    grammar_fill.py (the bitmask fill and matcher advance on this host's cores), then the structured rows
#         (#29: unconstrained, JSON, JSON under llguidance; SmolLM2's tokenizer) under the step trace, or ROWS
#   moe   fused_moe.py --tune (#26), its table put in kernels/ for this call, then ROWS (default: the DeepSeek-V2-Lite
#         row; $OUT/fused_moe_configs.json is the file to commit)
#   w4    w4a16_tc.py --tune (#31; its compiles spread over the CPUs), likewise, then ROWS (default: the W4 rows;
#         none: no rows; commit $OUT/w4a16_configs.json; W4_ARGS: more options, e.g. "--merge --rows 512,4096")
#   w4ab  w4a16_tc.py --wide-ab: the tc kernel with and without its WIDE dot at the same launches, vs cuBLAS (#31)
#   w4words  w4a16_tc.py --words-ab: the same with its 16-bit scales read as int32 words and as stored (#31)
#   w4even   w4a16_tc.py --even-ab: the same with and without the masks along N where the tile divides N (#31)
#   w4ncu the tc kernel at the table's launch, a 128 x 128 tile on 4 warps at 2 stages (two programs an SM) and a
#         256 x 128 tile on 8 warps, and cuBLAS bf16, under Nsight Compute (w4a16_tc.py --profile; W4AB_ROWS,
#         default 128,256; W4AB_SHAPES, default gate_up; NCU_S): ncu.txt (every section's details), ncu_raw.csv (every
#         metric), the report w4ncu.ncu-rep (#31: why the 128-256-row launches run at 0.47-0.67x cuBLAS's speed)
#   fam   h200_engine.py's float32 greedy check (correct32) of the Gemma-2-9B and Phi-3-mini shapes (#25; FAM_SHAPES
#         to name others), then ROWS
#   mla   h200_engine.py's mla_graphs (#26): an 8-layer DeepSeek-V2-Lite shape's greedy tokens with CUDA graphs forced
#         on against eager in float32, and both one's decode tok/s in bf16 (MLA_S), then ROWS if given
#   rows  ROWS alone (#25's HF peers: ROWS=gemma2_9b_512_hf_batch_half and phi3_mini_512_hf_batch_half, a call each)
#   samp  the sampling kernels (#24's batch 1): the split path's check and bench (with --sweep's launches) on the 8B's
#         128,256-token vocabulary, then ROWS (default: 8b_bs1)
#   goals the H200 rows an issue still waits on, shortest first: 8b_bs1 (#24), the unconstrained and JSON rows
#         with SmolLM2's tokenizer (#29: their ratio), then fam's float32 check (#25; FAM_S; FAM_SHAPES, here
#         phi3_mini,gemma2_2b unless given: one Gemma-2 and one Phi-3 shape, as the issue asks; the 9B's compiles
#         ran past 200 s on an H100), then ROWS if given
#   rope  RoPE fused into the KV store (rope_store_kvcache) on the 8B shape in bf16: checked bit for bit against
#         rotary_embedding + store_kvcache and timed against them at 1-256 tokens (#24's batch-1 row)
#   bs1   the 8B batch-1 decode step under torch.profiler (engine_host_profile --requests 1): its kernels by device
#         time (#24's batch-1 row), then ROWS if given
# MODE may name several, comma-separated (sv,bs1): each writes under $OUT/MODE, and a ROWS given applies to every one.
# ROWS: benchmarks/h200_rows.py row names, comma-separated; ROWS_S: their time limit in seconds.
set -u
if [[ $1 == *,* ]]; then  # several modes in one device call, each under its own folder
  top=$OUT
  for m in ${1//,/ }; do mkdir -p "$top/$m"; OUT="$top/$m" bash "$0" "$m"; done
  exit 0
fi
MODE=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
mkdir -p /tmp/p && ln -sfn "$PWD" /tmp/p/vserve
export PYTHONPATH=/tmp/site:/tmp/p PYTHONUNBUFFERED=1 VSERVE_NO_PROGRESS=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; echo "tree $(cat .whl/REV 2>/dev/null)"
  python3 -c "import transformers, torch, triton; print('transformers', transformers.__version__, 'torch',
torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/machine.txt"
rows() { timeout "${ROWS_S:-380}" python3 benchmarks/h200_rows.py --out "$OUT" --rows "${ROWS:-$1}" > "$OUT/rows.log" 2>&1; }
case $MODE in
host)
  timeout 150 python3 benchmarks/engine_host_profile.py qwen05b 0 30 --torch-profile "$OUT/tp" > "$OUT/hostprof.txt" 2>&1
  gzip -f "$OUT/tp/trace.json"
  rows qwen05b_512,startup_serve_8b,startup_generate_8b ;;
lora)
  timeout 170 python3 - "$OUT/lora_kernels.md" > "$OUT/lora_kernels.log" 2>&1 <<'PY'
import sys
import torch
from vserve.kernels import gpu_check as g
m, dt = g.MODELS["llama3-8b"], torch.bfloat16
checks, bench = g.check_lora("llama3-8b", m, dt, "cuda", False), g.bench_lora("llama3-8b", m, dt, "cuda", False)
text = (f"# LoRA kernels on {torch.cuda.get_device_name()}\n\n## check ({sum(r.ok for r in checks)}/{len(checks)})\n\n"
        + g.format_table(g.CHECK_HEADER, [r.cells() for r in checks]) + "\n\n## bench\n\n"
        + g.format_table(g.BENCH_HEADER, [r.cells() for r in bench]) + "\n")
open(sys.argv[1], "w").write(text)
print(text)
PY
  rows lora_8b_512_base,lora_8b_512_n8,lora_8b_bs1_base,lora_8b_bs1_n1,lora_8b_512_n1,lora_8b_512_n32 ;;
sv)  # under the step trace: each engine run's step interval, device wait and host time, constrained or not
  timeout 100 python3 benchmarks/grammar_fill.py --tokenizer .whl/smoltok --out "$OUT" > "$OUT/grammar_fill.log" 2>&1
  mkdir -p "$OUT/trace"
  VSERVE_STEP_TRACE_DIR="$OUT/trace" PYTHONPATH="benchmarks/steptrace:$PYTHONPATH" \
    VSERVE_BENCH_TOKENIZER=.whl/smoltok rows 8b_sv_512,8b_sv_512_json,8b_sv_512_json_guidance
  python3 benchmarks/steptrace/analyze.py "$OUT/trace" --all-runs > "$OUT/trace_summary.txt" 2>&1
  tar czf "$OUT/trace.tgz" -C "$OUT" trace && rm -rf "$OUT/trace" ;;
moe)
  timeout "${TUNE_S:-300}" python3 benchmarks/kernels/fused_moe.py --tune --out "$OUT" > "$OUT/moe_tune.log" 2>&1
  [ -f "$OUT/fused_moe_configs.json" ] && cp "$OUT/fused_moe_configs.json" kernels/
  rows deepseek_v2_lite_512 ;;
w4ab|w4words|w4even)  # the tc kernel with and without WIDE (w4words: its scales as int32 words; w4even: its N
  # masks) at the same launches, vs cuBLAS bf16 (W4AB_ROWS)
  flag=--wide-ab; [ "$MODE" = w4words ] && flag=--words-ab; [ "$MODE" = w4even ] && flag=--even-ab
  timeout "${TUNE_S:-300}" python3 benchmarks/kernels/w4a16_tc.py $flag --rows "${W4AB_ROWS:-1,8,32,128,256,1024}" \
    ${W4AB_SHAPES:+--shapes "$W4AB_SHAPES"} --out "$OUT" > "$OUT/$MODE.log" 2>&1
  grep -e "-ab " "$OUT/$MODE.log" | cut -c1-400 ;;
w4ncu)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "${NCU_S:-240}" "$ncu" --clock-control none --set full --kernel-name regex:'_tc_kernel|nvjet|gemm|xmma|cutlass' \
    -o "$OUT/w4ncu" python3 benchmarks/kernels/w4a16_tc.py --profile --rows "${W4AB_ROWS:-128,256}" \
    --shapes "${W4AB_SHAPES:-4096:28672}" --out "$OUT" > "$OUT/ncu_run.log" 2>&1
  "$ncu" --import "$OUT/w4ncu.ncu-rep" --print-details all > "$OUT/ncu.txt" 2>&1 \
    || "$ncu" --import "$OUT/w4ncu.ncu-rep" > "$OUT/ncu.txt" 2>&1
  "$ncu" --import "$OUT/w4ncu.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
  grep -E "profile |==PROF==|==ERROR==" "$OUT/ncu_run.log" | cut -c1-300
  grep -E "^  [_a-z].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per" \
    "$OUT/ncu.txt" | head -80 ;;
w4)
  timeout "${TUNE_S:-360}" python3 benchmarks/kernels/w4a16_tc.py --tune ${W4_ARGS:-} --out "$OUT" > "$OUT/w4_tune.log" 2>&1
  [ -f "$OUT/w4a16_configs.json" ] && cp "$OUT/w4a16_configs.json" kernels/
  [ "${ROWS:-}" = none ] || rows w4_bs1_bf16,w4_bs1_awq,w4_256_bf16,w4_256_awq ;;
fam)  # #25's fp32 greedy check of the Gemma-2-9B and Phi-3-mini shapes against HF, then ROWS if given
  timeout "${FAM_S:-400}" python3 benchmarks/h200_engine.py --sections correct32 --shapes "${FAM_SHAPES:-gemma2_9b,phi3_mini}" \
    --out "$OUT" > "$OUT/fam_correct32.log" 2>&1
  [ -n "${ROWS:-}" ] && rows "" ;;
samp)
  timeout 240 python3 - "$OUT/sampling.md" > "$OUT/sampling.log" 2>&1 <<'PY'
import sys
import torch
from vserve.kernels import gpu_check as g
m = g.MODELS["llama3-8b"]
checks = g.check_sampling("llama3-8b", m, torch.bfloat16, "cuda", False)
bench = g.bench_sampling("llama3-8b", m, "cuda", False, True)
text = (f"# sampling kernels on {torch.cuda.get_device_name()}\n\n## check ({sum(r.ok for r in checks)}/{len(checks)})\n\n"
        + g.format_table(g.CHECK_HEADER, [r.cells() for r in checks]) + "\n\n## bench\n\n"
        + g.format_table(g.BENCH_HEADER, [r.cells() for r in bench]) + "\n")
open(sys.argv[1], "w").write(text)
print(text)
PY
  rows 8b_bs1 ;;
rope)  # #24's batch 1: RoPE in the KV store's launch against the two kernels, checked and timed on the 8B shape
  timeout 120 python3 - > "$OUT/rope.md" 2> "$OUT/rope.log" <<'PY'
import torch
from vserve.kernels import gpu_check as g
m, dt = g.MODELS["llama3-8b"], torch.bfloat16
rows = [r for r in g.check_ops("llama3-8b", m, dt, "cuda", False) if "rotary" in r.kernel or "rope" in r.kernel]
bench = g.bench_rope_store("llama3-8b", m, dt, "cuda", False)
print(g.format_table(g.CHECK_HEADER, [r.cells() for r in rows]) + "\n\n"
      + g.format_table(g.BENCH_HEADER, [r.cells() for r in bench]))
PY
  cat "$OUT/rope.md" ;;
bs1)
  timeout 150 python3 benchmarks/engine_host_profile.py 8b 0 40 --requests 1 --torch-profile "$OUT/tp" \
    > "$OUT/bs1prof.txt" 2>&1
  gzip -f "$OUT/tp/trace.json"
  [ -n "${ROWS:-}" ] && rows "" ;;
goals)
  top=$OUT; mkdir -p "$top/bs1" "$top/json" "$top/fam"
  OUT=$top/bs1 ROWS=8b_bs1 ROWS_S=120 rows ""  # the first row on a fresh machine compiles every kernel
  OUT=$top/json VSERVE_BENCH_TOKENIZER=.whl/smoltok ROWS=8b_sv_512,8b_sv_512_json ROWS_S=150 rows ""
  OUT=$top/fam FAM_SHAPES=${FAM_SHAPES:-phi3_mini,gemma2_2b} bash "$0" fam
  ;;
mla)
  timeout "${MLA_S:-240}" python3 benchmarks/h200_engine.py --sections mla_graphs --out "$OUT" > "$OUT/mla_graphs.log" 2>&1
  tail -3 "$OUT/mla_graphs.log"
  [ -n "${ROWS:-}" ] && rows "" ;;
rows)
  rows "" ;;
esac
ls -la "$OUT"
