"""Quantized serving on the H200 (issue #7): kernel correctness, kernel speed, and the 8B shape end to end.

    python benchmarks/h200_quant.py --out $OUT --sections correct,speed,memory   # ~5 min
    python benchmarks/h200_quant.py --out $OUT --sections bs1,throughput         # ~5 min
    python benchmarks/h200_quant.py --out $OUT --sections sweep                  # launch-parameter grid, ~3 min
    python benchmarks/h200_quant.py --cpu-smoke --out /tmp/q   # tiny shapes on CPU (TRITON_INTERPRET=1)

Sections:
- correct: the W4A16 kernel (AWQ, GPTQ, GPTQ act-order, compressed-tensors pack) against its reference in bf16
  and fp16 on Llama-3-8B's linear shapes (K, N) x M in {1, 16, 256, 2048}; the per-token FP8/INT8 quantization
  (exact); fp8_linear (torch._scaled_mm) and int8_linear (torch._int_mm) against their emulations. "torch err"
  is cuBLAS's own error on the dequantized weight in the low dtype, for scale.
- speed: W4A16 GEMM (default launch), FP8 and INT8 W8A8 linears against bf16 F.linear at those shapes (CUDA-graph
  timing, as decode runs); sweep: a grid of launch parameters for the W4A16 kernel, best per shape.
- memory: weight bytes after building the 8B shape (torch.cuda.memory_allocated) for bf16, AWQ, GPTQ, FP8, INT8,
  beside the memory planner's weights_bytes.
- bs1: decode at batch 1 (prompt 128, 512 tokens) for bf16, AWQ and FP8; throughput: 256 requests (prompts
  U[100, 1024] random tokens, outputs U[100, 1024], ignore_eos) for bf16 and FP8. Dummy weights, 8B shape, the
  quantization read from config.json's quantization_config.

JSON goes to OUT/h200_quant.json after every section (merged into what earlier runs left there); a short table
of this run is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down of Llama-3-8B
MS = [1, 16, 256, 2048]
SWEEP_MS = [1, 4, 16, 64, 256]  # rows timed over the launch grid (sweep)
TINY_SHAPES, TINY_MS = [(256, 192), (384, 128)], [1, 16, 40]
GROUP = 128
BW = 4.27e12  # measured device-to-device copy, bytes/s (../shared/GPU.md)

AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": None}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}


def _ct(fmt: str, wtype: str, acts: bool) -> dict:
    args = dict(num_bits=8, type=wtype, symmetric=True, group_size=None, strategy="channel", dynamic=False)
    act = dict(num_bits=8, type=wtype, symmetric=True, group_size=None, strategy="token", dynamic=True)
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                          "input_activations": act if acts else None}}}


FP8_CFG, INT8_CFG = _ct("float-quantized", "float", True), _ct("int-quantized", "int", True)
QUANT = {"bf16": None, "awq": AWQ_CFG, "gptq": GPTQ_CFG, "fp8": FP8_CFG, "int8": INT8_CFG}


# ---------------------------------------------------------------------------------------------------- inputs


def w4_weight(layout: str, K: int, N: int, dev: str, act_order: bool = False):
    """Random valid checkpoint tensors of one [N, K] weight: (qweight, scales, qzeros, g_idx, bits, group)."""
    from vserve.quantize.formats import pack_int32

    def rand32(*shape):
        return torch.randint(-2**31, 2**31, shape, dtype=torch.int64, device=dev).to(torch.int32)

    G = K // GROUP
    scales = (torch.rand(G, N, device=dev) * 2e-3 + 1e-3).half()
    if layout == "awq":
        return rand32(K, N // 8), scales, rand32(G, N // 8), None, 4, GROUP
    if layout == "gptq":
        g = torch.arange(K, device=dev, dtype=torch.int32) // GROUP
        if act_order:
            g = g[torch.randperm(K, device=dev)]
        return rand32(K // 8, N), scales, rand32(G, N // 8), g if act_order else None, 4, GROUP
    assert layout == "pack"
    codes = torch.randint(0, 16, (N, K), device=dev, dtype=torch.int32)
    return pack_int32(codes.cpu(), 4).to(dev), scales.float().t().contiguous(), None, None, 4, GROUP


def w8_weight(kind: str, K: int, N: int, dev: str):
    from vserve.kernels.ops_ref import per_token_quant_ref

    w = torch.randn(N, K, device=dev) * 0.02
    q, s = per_token_quant_ref(w, torch.float8_e4m3fn if kind == "fp8" else torch.int8)  # per output channel
    return q, s


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _rel(a, b) -> float:
    return _err(a, b) / max(float(b.float().abs().max()), 1e-30)


# ---------------------------------------------------------------------------------------------------- sections


def section_correct(res: dict, dev: str, shapes, ms, dtypes) -> None:
    from vserve.kernels import ops_ref, scaled_mm, triton_ops, triton_w4a16, w4a16_ref

    rows = []
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
    for K, N in shapes:
        for layout, act in (("awq", False), ("gptq", False), ("gptq", True), ("pack", False)):
            qw, s, z, g, bits, gs = w4_weight(layout, K, N, dev, act)
            w32 = w4a16_ref.dequantize_weight(qw, s, z, g, layout, bits, gs)
            for dtype in dtypes:
                wlow = w32.to(dtype)
                for M in ms:
                    x = torch.randn(M, K, device=dev).to(dtype)
                    out = torch.full((M, N), float("nan"), dtype=dtype, device=dev)
                    got = triton_w4a16.w4a16_gemm(x, qw, s, z, g, layout, bits, gs, out=out)
                    ref = w4a16_ref.w4a16_gemm_ref(x, qw, s, z, g, layout, bits, gs)
                    rel, torch_rel = _rel(got, ref), _rel(torch.nn.functional.linear(x, wlow), ref)
                    rows.append(dict(kernel="w4a16_gemm", layout=layout + ("-act-order" if act else ""), K=K, N=N,
                                     M=M, dtype=str(dtype).split(".")[-1], rel_err=rel, torch_rel_err=torch_rel,
                                     ok=bool(rel <= max(tol[dtype], 2 * torch_rel))))
            del w32
        for kind in ("fp8", "int8"):
            wq, ws = w8_weight(kind, K, N, dev)
            lin, lin_ref = (scaled_mm.fp8_linear, scaled_mm.fp8_linear_ref) if kind == "fp8" else \
                (scaled_mm.int8_linear, scaled_mm.int8_linear_ref)
            for dtype in dtypes:
                for M in ms:
                    x = torch.randn(M, K, device=dev).to(dtype)
                    qdt = torch.float8_e4m3fn if kind == "fp8" else torch.int8
                    q, qs = triton_ops.per_token_quant(x, qdt)
                    rq, rqs = ops_ref.per_token_quant_ref(x, qdt)
                    exact = bool(torch.equal(qs, rqs) and torch.equal(q.float(), rq.float()))
                    try:
                        got, ref = lin(x, wq, ws), lin_ref(x, wq, ws)
                        rel, err = _rel(got, ref), ""
                    except Exception as e:  # an unsupported dtype/shape of this torch: say so, keep going
                        rel, err = float("nan"), f"{type(e).__name__}: {str(e)[:160]}"
                    rows.append(dict(kernel=f"{kind}_linear", layout="channel", K=K, N=N, M=M,
                                     dtype=str(dtype).split(".")[-1], rel_err=rel, quant_exact=exact,
                                     ok=exact and rel <= tol[dtype], error=err))
    res["correct"] = rows


def section_speed(res: dict, dev: str, shapes, ms, sweep_ms) -> None:
    from vserve.kernels import scaled_mm, triton_w4a16
    from vserve.kernels.gpu_check import time_ms

    rows, best = [], []
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float16
    for K, N in shapes:
        w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
        qw, s, z, g, bits, gs = w4_weight("awq", K, N, dev)
        fp8 = w8_weight("fp8", K, N, dev) if dev.startswith("cuda") else None
        int8 = w8_weight("int8", K, N, dev)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            awq = partial(triton_w4a16.w4a16_gemm, x, qw, s, z, None, "awq", 4, gs)
            row = dict(K=K, N=N, M=M, bf16_ms=time_ms(partial(torch.nn.functional.linear, x, w), dev)[0],
                       awq_ms=time_ms(awq, dev)[0], awq_fused_ms=time_ms(partial(awq, dequant_m=1 << 30), dev)[0],
                       awq_dequant_cublas_ms=time_ms(partial(awq, dequant_m=1), dev)[0])
            for name, wt in (("fp8", fp8), ("int8", int8)):
                if wt is None:
                    continue
                fn = scaled_mm.fp8_linear if name == "fp8" else scaled_mm.int8_linear
                try:
                    row[f"{name}_ms"] = time_ms(partial(fn, x, *wt), dev)[0]
                except Exception as e:
                    row[f"{name}_ms"], row[f"{name}_error"] = None, f"{type(e).__name__}: {str(e)[:160]}"
            row["awq_speedup_vs_bf16"] = row["bf16_ms"] / row["awq_ms"]
            row["awq_GBps"] = (K * N / 2 + K // gs * N * 2.5) / (row["awq_ms"] * 1e-3) / 1e9
            rows.append(row)
        for M in sweep_ms:
            best.append(_sweep(qw, s, z, gs, torch.randn(M, K, device=dev, dtype=dtype), dev))
    res["speed"] = rows
    if best:
        res["sweep"] = best


def _sweep(qw, s, z, gs, x, dev: str) -> dict:
    """Time a grid of launch parameters for this (M, K, N); the fastest few."""
    from vserve.kernels import triton_w4a16
    from vserve.kernels.gpu_check import time_ms

    M = x.shape[0]
    if M == 1:  # the GEMV kernel (split_k is not a compile-time constant)
        grid = [dict(block_m=1, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=st)
                for bn in (64, 128, 256) for bk in (32, 64, 128) for sk in (4, 8, 16, 32) for w in (2, 4, 8)
                for st in (2, 4)]
    elif M <= 16:
        grid = [dict(block_m=16, block_n=bn, block_k=bk, split_k=sk, num_warps=w, num_stages=st)
                for bn in (32, 64, 128) for bk in (64, 128) for sk in (1, 2, 4, 8, 16) for w in (4, 8)
                for st in (3, 4)]
    else:
        grid = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=1, num_warps=w, num_stages=3)
                for bm in (64, 128) for bn in (64, 128) for bk in (32, 64) for w in (4, 8)]
    fused = partial(triton_w4a16.w4a16_gemm, x, qw, s, z, None, "awq", 4, gs, dequant_m=1 << 30)
    timed = []
    for cfg in grid:
        try:
            timed.append((time_ms(partial(fused, **cfg), dev)[0], cfg))
        except Exception:  # out of shared memory etc.
            continue
    timed.sort(key=lambda t: t[0])
    default = time_ms(fused, dev)[0]
    return dict(M=M, K=x.shape[1], N=s.shape[1], default_ms=default, best=[dict(ms=t, **c) for t, c in timed[:8]])


def _model_cfg(base: dict, quant: str) -> dict:
    cfg = dict(base)
    if QUANT[quant] is not None:
        cfg["quantization_config"] = QUANT[quant]
    return cfg


def section_memory(res: dict, dev: str, base: dict) -> None:
    from h200_engine import free_gpu, model_dir

    from vserve.core.loader import build_model
    from vserve.core.memory import weights_bytes
    from vserve.core.model_config import ModelConfig

    rows = {}
    for q in QUANT:
        cfg = _model_cfg(base, q)
        mc = ModelConfig.from_dict(cfg)
        free_gpu()
        before = torch.cuda.memory_allocated()
        model = build_model(mc, Path(model_dir(cfg)), "dummy", torch.bfloat16, torch.device(dev))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        rows[q] = dict(allocated_bytes=held, params_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                       planner_bytes=weights_bytes(mc, 2, model.quant_config))
        del model
        free_gpu()
    for q in rows:
        rows[q]["vs_bf16"] = rows[q]["allocated_bytes"] / rows["bf16"]["allocated_bytes"]
    res["memory"] = rows


def section_bs1(res: dict, base: dict) -> None:
    from h200_engine import run_vserve, workload

    p, _ = workload(1, 3, base["vocab_size"], (512, 512), in_len=(128, 128))
    for q in ("bf16", "awq", "fp8"):
        res[f"bs1_in128_out512_{q}"] = _drop_plan(run_vserve(_model_cfg(base, q), p, [512], max_num_seqs=8,
                                                             enforce_eager=False))


def section_throughput(res: dict, base: dict, runs=(("bf16", "auto"), ("fp8", "auto"))) -> None:
    """256 requests, outputs U[100, 1024], for each (weights, --kv-cache-dtype) of runs, in this process. The
    throughput_kv section: bf16 with the model-dtype cache beside bf16 and FP8 W8A8 weights over an fp8 cache."""
    from h200_engine import run_vserve, workload

    p, o = workload(256, 0, base["vocab_size"], (100, 1024))
    for q, kv in runs:
        key = f"throughput_256_u100_1024_{q}" + ("" if kv == "auto" else f"_kv_{kv}")
        res[key] = _drop_plan(run_vserve(_model_cfg(base, q), p, o, max_num_seqs=256, enforce_eager=False,
                                         kv_cache_dtype=kv))


def _drop_plan(r: dict) -> dict:
    """run_vserve's record without the (bf16-only) roofline and doctor fields, which do not apply here."""
    return {k: v for k, v in r.items() if k not in ("bound_s", "bound_tok_s", "frac_of_bound", "doctor_prediction")}


def section_smoke_e2e(res: dict) -> None:
    """CPU smoke: a tiny Llama shape with dummy weights in every layout generates tokens."""
    from h200_engine import LLAMA3_8B, model_dir

    from vserve import LLM, SamplingParams

    tiny = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    for q in QUANT:
        llm = LLM(model_dir(_model_cfg(tiny, q)), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                  device="cpu", num_kv_blocks=32)
        t0 = time.perf_counter()
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        res[f"smoke_{q}"] = dict(tokens=out[0].outputs[0].token_ids, seconds=time.perf_counter() - t0)
        llm.llm_engine.shutdown()


# ---------------------------------------------------------------------------------------------------- report


def summary(res: dict) -> str:
    lines = []
    if "correct" in res:
        bad = [r for r in res["correct"] if not r["ok"]]
        worst = max((r["rel_err"] for r in res["correct"] if r["rel_err"] == r["rel_err"]), default=float("nan"))
        lines.append(f"correct: {len(res['correct']) - len(bad)}/{len(res['correct'])} pass, worst rel err "
                     f"{worst:.2e}" + "".join(f"\n  FAIL {r}" for r in bad[:10]))
    if "speed" in res:
        lines.append("speed (ms):     K      N      M   bf16    awq  fused  deq+mm    fp8   int8  awq x")
        for r in res["speed"]:
            cells = [r.get(k) for k in ("bf16_ms", "awq_ms", "awq_fused_ms", "awq_dequant_cublas_ms", "fp8_ms",
                                        "int8_ms")]
            lines.append(f"           {r['K']:>6} {r['N']:>6} {r['M']:>6} " +
                         " ".join("     -" if c is None else f"{c:6.3f}" for c in cells) +
                         f" {r['awq_speedup_vs_bf16']:5.2f}")
    if "memory" in res:
        lines.append("weights: " + ", ".join(f"{q} {r['allocated_bytes'] / 2**30:.2f} GiB ({r['vs_bf16']:.2f}x, "
                                             f"planner {r['planner_bytes'] / 2**30:.2f})"
                                             for q, r in res["memory"].items()))
    if res.get("device") == "cpu (smoke)":
        lines.append("cpu smoke: timings mean nothing")
    for k, v in res.items():
        if k.startswith("smoke_"):
            lines.append(f"{k}: {v['tokens']}")
        if isinstance(v, dict) and "output_tok_s" in v:
            lines.append(f"{k}: {v['output_tok_s']:.1f} tok/s ({v['output_tokens']} tokens in {v['seconds']:.1f} s)")
        if k.endswith("_error"):
            lines.append(f"{k}: {str(v).strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="correct,speed,memory,bs1,throughput",
                    help="comma-separated, of correct, speed, sweep, memory, bs1, throughput, throughput_kv")
    ap.add_argument("--sweep-ms", type=lambda v: [int(m) for m in v.split(",")], default=SWEEP_MS,
                    help="rows timed over the launch grid (sweep), comma-separated")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        os.environ.setdefault("VSERVE_NO_PROGRESS", "1")
        torch.set_num_threads(1)
        sections = {"correct": lambda r: section_correct(r, "cpu", TINY_SHAPES, TINY_MS, [torch.float16]),
                    "speed": lambda r: section_speed(r, "cpu", TINY_SHAPES[:1], [1], sweep_ms=()),
                    "e2e": section_smoke_e2e}
        res: dict = {"torch": torch.__version__, "device": "cpu (smoke)"}
    else:
        if not torch.cuda.is_available():
            print("h200_quant.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
            return 2
        from h200_engine import LLAMA3_8B

        dtypes = [torch.bfloat16, torch.float16]
        names = args.sections.split(",")
        sections = {"correct": lambda r: section_correct(r, "cuda", SHAPES, MS, dtypes),
                    "speed": lambda r: section_speed(r, "cuda", SHAPES, MS, args.sweep_ms if "sweep" in names else ()),
                    "memory": lambda r: section_memory(r, "cuda", LLAMA3_8B),
                    "bs1": lambda r: section_bs1(r, LLAMA3_8B),
                    "throughput": lambda r: section_throughput(r, LLAMA3_8B),
                    "throughput_kv": lambda r: section_throughput(r, LLAMA3_8B, (("bf16", "auto"), ("bf16", "fp8"),
                                                                                 ("fp8", "fp8")))}
        sections = {n: f for n, f in sections.items() if n in names or (n == "speed" and "sweep" in names)}
        res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "capability": torch.cuda.get_device_capability()}
    path = out / "h200_quant.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    for name, fn in sections.items():
        t0 = time.perf_counter()
        try:
            fn(res)
        except Exception as e:  # keep the other sections' numbers
            res[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"section {name} failed: {e!r}", flush=True)
        res[f"{name}_section_s"] = time.perf_counter() - t0
        path.write_text(json.dumps({**earlier, **res}, indent=1, default=str))
    print(summary(res))
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
