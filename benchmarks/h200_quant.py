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
from contextlib import contextmanager
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
                    # FP8: the split-K kernel's dots accumulate as fast accumulation does, in fp16 too (scaled_mm)
                    limit = tol[torch.bfloat16] if kind == "fp8" else tol[dtype]
                    rows.append(dict(kernel=f"{kind}_linear", layout="channel", K=K, N=N, M=M,
                                     dtype=str(dtype).split(".")[-1], rel_err=rel, quant_exact=exact,
                                     ok=exact and rel <= limit, error=err))
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


def _run_256(base: dict, q: str, kv: str = "auto", decode: dict | None = None) -> dict:
    """One run of the throughput workload (256 requests, prompts U[100, 1024] of random tokens, outputs U[100, 1024],
    ignore_eos) with weights q over a kv cache, decode attention launched with the overrides `decode` (None: the
    defaults)."""
    from h200_engine import run_vserve, workload

    p, o = workload(256, 0, base["vocab_size"], (100, 1024))
    decode_config(decode)
    try:
        return _drop_plan(run_vserve(_model_cfg(base, q), p, o, max_num_seqs=256, enforce_eager=False,
                                     kv_cache_dtype=kv))
    finally:
        decode_config(None)


def section_throughput(res: dict, base: dict, runs=(("bf16", "auto"), ("fp8", "auto"))) -> None:
    """256 requests, outputs U[100, 1024], for each (weights, --kv-cache-dtype) of runs, in this process. The
    throughput_kv section: bf16 with the model-dtype cache beside bf16 and FP8 W8A8 weights over an fp8 cache."""
    for q, kv in runs:
        res[f"throughput_256_u100_1024_{q}" + ("" if kv == "auto" else f"_kv_{kv}")] = _run_256(base, q, kv)


def section_throughput_pair(res: dict, base: dict, repeats: int = 2) -> None:
    """The 1.4x goal's pair, bf16 and FP8 W8A8 + fp8 KV, alternated `repeats` times in this process (the spread
    between repeats is the noise the ratio carries)."""
    for i in range(repeats):
        for q, kv in (("bf16", "auto"), ("fp8", "fp8")):
            res[f"throughput_256_u100_1024_{q}_kv_{kv}_r{i + 1}"] = _run_256(base, q, kv)


def section_throughput_partition(res: dict, base: dict) -> None:
    """FP8 W8A8 + fp8 KV with the default decode partitions and with 2,048-token partitions at every batch size,
    alternated twice (bf16 once first, for the ratio)."""
    runs = [("bf16", "auto", None, "")] + [("fp8", "fp8", c, f"_{lbl}_r{i}") for i in (1, 2)
                                           for lbl, c in (("default", None), ("p2048", dict(partition_size=2048)))]
    for q, kv, cfg, tag in runs:
        r = res[f"throughput_256_u100_1024_{q}_kv_{kv}{tag}"] = _run_256(base, q, kv, cfg)
        print(f"{q}{tag}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_throughput_reduce(res: dict, base: dict) -> None:
    """bf16 and FP8 W8A8 + fp8 KV, each with the decode partials combined by the last partition (the default) and
    by the reduce kernel (fused_reduce=False), alternated."""
    for q, kv in (("bf16", "auto"), ("fp8", "fp8")):
        for label, c in (("fused", None), ("reduce_kernel", dict(fused_reduce=False))):
            r = res[f"throughput_256_u100_1024_{q}_kv_{kv}_{label}"] = _run_256(base, q, kv, c)
            print(f"{q} {label}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_throughput_pair_warm(res: dict, base: dict) -> None:
    """throughput_pair after one untimed-for-the-ratio run of each (bf16, then FP8 + fp8 KV): a fresh process compiles
    Triton variants during its first runs (up to ~1 s stalls in a mixed step), which would land in the pair's first
    runs otherwise."""
    for q, kv in (("bf16", "auto"), ("fp8", "fp8")):
        r = res[f"throughput_256_u100_1024_{q}_kv_{kv}_warm"] = _run_256(base, q, kv)
        print(f"{q} warm: {r['output_tok_s']:.1f} tok/s", flush=True)
    section_throughput_pair(res, base)


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


def section_pdl_check(res: dict, base: dict) -> None:
    """Greedy batch-1 tokens (CUDA graphs) of bf16 and AWQ with programmatic dependent launch (triton_ops.PDL) and
    without: the same tokens expected (PDL changes when kernels start, not what they compute)."""
    from h200_engine import free_gpu, model_dir, workload

    from vserve import LLM, SamplingParams
    from vserve.kernels import triton_ops

    prompts, _ = workload(3, 5, base["vocab_size"], (64, 64), in_len=(128, 128))
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for q in ("bf16", "awq"):
        got = {}
        for pdl in (False, True):
            with _patched(triton_ops, PDL=pdl):
                llm = LLM(model_dir(_model_cfg(base, q)), load_format="dummy", skip_tokenizer_init=True,
                          dtype="bfloat16", max_num_seqs=8)
                got[pdl] = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
                llm.llm_engine.shutdown()
                del llm
                free_gpu()
        res[f"pdl_check_{q}"] = dict(same_tokens=got[True] == got[False], tokens=sum(map(len, got[True])))
        print(f"pdl_check {q}: {res[f'pdl_check_{q}']}", flush=True)


GEMV_COLD_GRID = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=sk) for bn in (512, 1024, 2048) for bk in (4, 8)
                  for w in (4, 8) for sk in (8, 16, 32, 64) if bn * bk <= 8192]
GEMV_COLD_GRID_WIDE = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=sk) for bn in (256, 512, 1024)
                       for bk in (8, 16) for w in (2, 4) for sk in (8, 16, 32, 64, 128) if bn * bk <= 8192]
GEMV_GRID = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=sk) for bn in (512, 1024, 2048) for bk in (4, 8, 16)
             for w in (2, 4, 8) for sk in (2, 4, 8, 16, 32)]


def _cold_awq_and_bf16(K: int, N: int, dev: str, cold_bytes: int) -> tuple[list, list]:
    """Enough copies of a random AWQ [N, K] weight ((qweight, scales, qzeros) each) and of a bf16 one that cycling
    through either reads at least cold_bytes, so no call finds its weight in L2 (as in a decode step)."""
    copies = [w4_weight("awq", K, N, dev)[:3] for _ in range(max(1, -(-cold_bytes // (K * N // 2))))]
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
          for _ in range(max(1, -(-cold_bytes // (K * N * 2))))]
    return copies, ws


def section_gemv(res: dict, dev: str, shapes, grid=GEMV_GRID, cold: bool = False, cold_bytes: int = 256 << 20) -> None:
    """The AWQ batch-1 GEMV (_awq_gemv_kernel): against its reference in bf16 and fp16 (default launch, with and
    without the in-kernel split fixup), then timed beside bf16 F.linear over a launch grid; best per shape. cold:
    each timed call runs over enough weight copies that none is still in L2 (as in a decode step)."""
    from vserve.kernels import triton_w4a16, w4a16_ref
    from vserve.kernels.gpu_check import time_ms

    checks, rows = [], []
    for K, N in shapes:
        qw, s, z, _, _, gs = w4_weight("awq", K, N, dev)
        w32 = w4a16_ref.dequantize_weight(qw, s, z, None, "awq", 4, gs)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(1, K, device=dev).to(dtype)
            ref = w4a16_ref.w4a16_gemm_ref(x, qw, s, z, None, "awq", 4, gs)
            torch_rel = _rel(torch.nn.functional.linear(x, w32.to(dtype)), ref)
            for fixup in (True, False):
                got = triton_w4a16.w4a16_gemm(x, qw, s, z, None, "awq", 4, gs, fixup=fixup)
                again = triton_w4a16.w4a16_gemm(x, qw, s, z, None, "awq", 4, gs, fixup=fixup)
                rel = _rel(got, ref)
                checks.append(dict(K=K, N=N, dtype=str(dtype).split(".")[-1], fixup=fixup, rel_err=rel,
                                   torch_rel_err=torch_rel, deterministic=bool(torch.equal(got, again)),
                                   ok=bool(rel <= max(2e-3 if dtype == torch.float16 else 1.6e-2, 2 * torch_rel))))
        del w32
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        if cold:  # as in a decode step, each call's weights are not in L2: cycle through copies > 4x L2
            copies, ws = _cold_awq_and_bf16(K, N, dev, cold_bytes)
            reps, wreps = len(copies), len(ws)
        else:
            copies, reps = [(qw, s, z)], 1
            ws, wreps = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02], 1

        def fn(_c=copies, _x=x, _gs=gs, **kw):
            for c in _c:
                triton_w4a16.w4a16_gemm(_x, *c, None, "awq", 4, _gs, **kw)

        def bf16(_ws=ws, _x=x):
            for w in _ws:
                torch.nn.functional.linear(_x, w)

        def each(f, n, _iters=4 if cold else 20):  # ms per GEMM
            return time_ms(f, dev, iters=_iters)[0] / n

        row = dict(K=K, N=N, cold=cold, bf16_ms=each(bf16, wreps), default_ms=each(fn, reps),
                   default_nofixup_ms=each(partial(fn, fixup=False), reps))
        timed = []
        for cfg in grid:
            try:
                timed.append((each(partial(fn, **cfg), reps), cfg))
            except Exception:  # out of registers etc.
                continue
        timed.sort(key=lambda t: t[0])
        row["best"] = [dict(ms=t, **c) for t, c in timed[:6]]
        if timed:
            row["best_nofixup_ms"] = each(partial(fn, fixup=False, **timed[0][1]), reps)
        nbytes = K * N / 2 + K // gs * N * 2.5  # codes + fp16 scales + packed zeros
        row["default_TBps"] = nbytes / (row["default_ms"] * 1e-3) / 1e12
        row["best_TBps"] = nbytes / (timed[0][0] * 1e-3) / 1e12 if timed else None
        row["bf16_TBps"] = K * N * 2 / (row["bf16_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(f"gemv {K}x{N}: bf16 {row['bf16_ms']:.4f} ms, awq default {row['default_ms']:.4f}, best "
              f"{row['best'][0] if row['best'] else None}", flush=True)
    res["gemv_correct"] = checks
    res["gemv_cold" if cold else "gemv"] = rows


def section_bs1_awq(res: dict, base: dict, runs: list | None = None) -> None:
    """Batch-1 decode, bf16 against AWQ with the default GEMV launch and with the gemv section's best launch per
    shape (when that section ran first in this process). runs: (result key, quantization, best-launch table or
    None, {triton_w4a16 attribute (triton_ops attribute: "ops." and its name): value} to set for the run)
    instead."""
    from h200_engine import run_vserve, workload

    from vserve.kernels import triton_ops, triton_w4a16

    p, _ = workload(1, 3, base["vocab_size"], (512, 512), in_len=(128, 128))
    if runs is None:
        runs = [("bs1_in128_out512_bf16", "bf16", None, {}), ("bs1_in128_out512_awq", "awq", None, {})]
        best = _best_launches(res.get("gemv_cold", res.get("gemv", [])))
        if best:
            runs.append(("bs1_in128_out512_awq_gemv_best", "awq", best, {}))
    orig = triton_w4a16._config
    for key, q, table, attrs in runs:
        patch = {k: v for k, v in attrs.items() if not k.startswith("ops.")}
        ops_patch = {k[4:]: v for k, v in attrs.items() if k.startswith("ops.")}
        if table:
            def tuned(M, N, K, device, layout="", _t=table):
                c = _t.get((K, N))
                if M == 1 and layout == "awq" and c is not None:
                    keys = ("block_n", "block_k", "num_warps", "split_k")
                    return dict(block_m=1, num_stages=c.get("num_stages", 1), **{k: c[k] for k in keys})
                return orig(M, N, K, device, layout)
            patch["_config"] = tuned
        with _patched(triton_w4a16, **patch), _patched(triton_ops, **ops_patch):
            res[key] = _drop_plan(run_vserve(_model_cfg(base, q), p, [512], max_num_seqs=8, enforce_eager=False))
        print(f"{key}: {res[key]['output_tok_s']:.1f} tok/s", flush=True)


@contextmanager
def _patched(module, **attrs):
    """The module's attributes set to attrs inside the block, restored after it."""
    saved = {a: getattr(module, a) for a in attrs}
    try:
        for a, v in attrs.items():
            setattr(module, a, v)
        yield
    finally:
        for a, v in saved.items():
            setattr(module, a, v)


W4_DEQUANT_MS = [16, 24, 32, 48, 64, 96, 128, 192, 256]


def section_w4_dequant(res: dict, base: dict, dev: str = "cuda", cold_bytes: int = 256 << 20) -> None:
    """Where dequantize + cuBLAS (triton_w4a16.DEQUANT_M) should take over from the fused W4A16 kernels: per shape
    and decode-sized row count, AWQ through the fused kernels and through dequantize + cuBLAS beside bf16 F.linear,
    each timed in a CUDA graph over weight copies that no longer fit L2 (as in a decode step); then 256 requests of
    AWQ with DEQUANT_M at the old 1024 and at candidate thresholds, beside bf16 (this process)."""
    from vserve.kernels import triton_w4a16
    from vserve.kernels.gpu_check import time_ms

    rows = []
    for K, N in SHAPES:
        copies, ws = _cold_awq_and_bf16(K, N, dev, cold_bytes)
        for M in W4_DEQUANT_MS:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

            def awq(dequant_m, _c=copies, _x=x):
                for c in _c:
                    triton_w4a16.w4a16_gemm(_x, *c, None, "awq", 4, GROUP, dequant_m=dequant_m)

            def bf16(_ws=ws, _x=x):
                for w in _ws:
                    torch.nn.functional.linear(_x, w)

            row = dict(K=K, N=N, M=M, bf16_ms=time_ms(bf16, dev, iters=4)[0] / len(ws),
                       fused_ms=time_ms(partial(awq, 1 << 30), dev, iters=4)[0] / len(copies),
                       dequant_cublas_ms=time_ms(partial(awq, 1), dev, iters=4)[0] / len(copies))
            rows.append(row)
            print(f"w4 {K}x{N} M={M}: bf16 {row['bf16_ms']:.4f}, fused {row['fused_ms']:.4f}, dequant+cuBLAS "
                  f"{row['dequant_cublas_ms']:.4f} ms", flush=True)
        del copies, ws
    res["w4_dequant"] = rows
    res["w4_dequant_256_bf16"] = _run_256(base, "bf16")
    for m in (1024, 64, 32, 17):
        with _patched(triton_w4a16, DEQUANT_M=m, DEQUANT_M_WIDE=m):
            r = res[f"w4_dequant_256_awq_dequant_m{m}"] = _run_256(base, "awq")
        print(f"awq, DEQUANT_M {m}: {r['output_tok_s']:.1f} tok/s", flush=True)
    print(f"bf16: {res['w4_dequant_256_bf16']['output_tok_s']:.1f} tok/s", flush=True)


def section_w4_dequant_e2e(res: dict, base: dict) -> None:
    """AWQ with dequantize + cuBLAS from 1024 rows (before), from 32 rows for every shape, and from the shipped
    thresholds (DEQUANT_M, DEQUANT_M_WIDE), on 256 and on 32 requests (prompts and outputs U[100, 1024]), beside
    bf16 (this process)."""
    from h200_engine import run_vserve, workload

    from vserve.kernels import triton_w4a16

    for n in (256, 32):
        p, o = workload(n, 0, base["vocab_size"], (100, 1024))
        for label, q, m in (("bf16", "bf16", {}), ("awq_before", "awq", dict(DEQUANT_M=1024, DEQUANT_M_WIDE=1024)),
                            ("awq_flat32", "awq", dict(DEQUANT_M=32, DEQUANT_M_WIDE=32)), ("awq_shipped", "awq", {})):
            with _patched(triton_w4a16, **m):
                r = res[f"w4_dequant_e2e_{n}_{label}"] = _drop_plan(run_vserve(
                    _model_cfg(base, q), p, o, max_num_seqs=n, enforce_eager=False))
            print(f"{n} requests, {label}: {r['output_tok_s']:.1f} tok/s", flush=True)


def _best_launches(rows: list[dict]) -> dict:
    """{(K, N): the fastest launch} from section_gemv's rows."""
    return {(r["K"], r["N"]): r["best"][0] for r in rows if r.get("best")}


def section_awq_variants(res: dict, base: dict, name: str, attr: str, values: tuple, grid=GEMV_COLD_GRID) -> None:
    """Variants of the AWQ GEMV (triton_w4a16.<attr> set to each of values in turn, e.g. AWQ_FIXUP_UNROLL): each
    checked and timed cold over the launch grid, then batch-1 decode beside bf16 with each one's default and best
    launches (results under name)."""
    from vserve.kernels import triton_w4a16

    best = {}
    for v in values:
        sub: dict = {}
        with _patched(triton_w4a16, **{attr: v}):
            section_gemv(sub, "cuda", SHAPES, grid, cold=True)
        res[f"{name}_gemv_cold_{v}"], res[f"{name}_gemv_correct_{v}"] = sub["gemv_cold"], sub["gemv_correct"]
        best[v] = _best_launches(sub["gemv_cold"])
    runs = [(f"{name}_bs1_bf16", "bf16", None, {})]
    for v in values:
        runs += [(f"{name}_bs1_{v}_default", "awq", None, {attr: v}),
                 (f"{name}_bs1_{v}_best", "awq", best[v], {attr: v})]
    runs += [(f"{name}_bs1_bf16_again", "bf16", None, {})] + [(f"{name}_bs1_{v}_default_again", "awq", None, {attr: v})
                                                               for v in values]
    section_bs1_awq(res, base, runs)


AWQ_GEMV_GRID = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=sk, num_stages=st) for bn in (512, 1024)
                 for bk in (4, 8, 16) for w in (4, 8, 16) for sk in (8, 16, 32, 64) for st in (1, 2, 3)
                 if bk * w <= 128 and bn // 8 * bk * w * 4 * max(st - 1, 1) <= 160 << 10]


# narrower column blocks with more K-splits: more programs for the small qkv and o_proj grids
AWQ_GEMV_NARROW = [dict(block_n=bn, block_k=16, num_warps=w, split_k=sk, num_stages=st) for bn in (128, 256)
                   for w in (2, 4, 8) for sk in (32, 64, 128) for st in (1, 3)]
# wider programs for gate_up (N = 28672), under programmatic dependent launch (session 21)
AWQ_GEMV_WIDE = [dict(block_n=bn, block_k=bk, num_warps=w, split_k=sk, num_stages=1) for bn in (512, 1024)
                 for bk in (8, 16) for w in (4, 8) for sk in (8, 16, 32)]
# 256 and 512 columns, around the defaults (session 21, with programmatic dependent launch)
AWQ_GEMV_PDL = [dict(block_n=bn, block_k=16, num_warps=w, split_k=sk, num_stages=st) for bn in (256, 512)
                for w in (2, 4, 8) for sk in (16, 32, 64) for st in (1, 3)]


def section_awq_gemv(res: dict, base: dict, grid=AWQ_GEMV_GRID) -> None:
    """The AWQ GEMV checked and timed cold at its default launch and over grid; then batch-1 decode: bf16, then AWQ
    with the default and with the best launch per shape (the default when grid is empty), each engine twice
    (alternated; the first AWQ run of a process is a warm-up)."""
    sub: dict = {}
    section_gemv(sub, "cuda", SHAPES, grid, cold=True)
    res["awq_gemv_cold"], res["awq_gemv_correct"] = sub["gemv_cold"], sub["gemv_correct"]
    best = _best_launches(sub["gemv_cold"])
    runs = []
    for rep in ("", "_again"):
        runs += [(f"awq_gemv_bs1_bf16{rep}", "bf16", None, {}), (f"awq_gemv_bs1_default{rep}", "awq", None, {}),
                 (f"awq_gemv_bs1_best{rep}", "awq", best, {})]
    section_bs1_awq(res, base, runs)


AWQ_ROWS_MS = (2, 4, 8, 16, 24, 32, 64)
AWQ_TILE_GRID = [dict(block_m=16, block_n=bn, block_k=bk, num_warps=w, split_k=sk, num_stages=st)
                 for bn, bk, w, sk, st in ((128, 128, 4, 8, 2), (128, 128, 8, 8, 2), (128, 128, 4, 8, 3),
                                           (128, 64, 4, 8, 2), (128, 64, 4, 8, 4), (128, 128, 4, 4, 2),
                                           (128, 128, 4, 16, 3), (256, 128, 8, 4, 2), (256, 64, 8, 8, 3))]


def section_awq_rows(res: dict, dev: str = "cuda", cold_bytes: int = 256 << 20, grid=AWQ_TILE_GRID) -> None:
    """AWQ on a few rows (decode batches 2-64): the tile kernel's exact path (x times the exact q - z, then the
    scales) and the few-row GEMV checked against the reference on the GPU (bf16 and fp16), then per shape and row
    count, cold (weight copies beyond L2, CUDA graph): bf16 F.linear, the GEMV (up to 4 rows), the tile kernel with
    its old dequantization and its exact path at the default launch and over grid (up to 16 rows), dequantize +
    cuBLAS."""
    from vserve.kernels import triton_w4a16, w4a16_ref
    from vserve.kernels.gpu_check import time_ms

    checks, rows = [], []
    for K, N in SHAPES + [(4096, 200)]:
        qw, s, z, _, _, gs = w4_weight("awq", K, N, dev)
        w32 = w4a16_ref.dequantize_weight(qw, s, z, None, "awq", 4, gs)
        for M, path, kw in ((2, "gemv", {}), (3, "gemv", dict(block_m=1)), (5, "tile", {}), (16, "tile", {}),
                            (40, "tile64", dict(dequant_m=1 << 30))):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(M, K, device=dev).to(dtype)
                x[0, ::97] *= 100
                ref = w4a16_ref.w4a16_gemm_ref(x, qw, s, z, None, "awq", 4, gs)
                torch_rel = _rel(torch.nn.functional.linear(x, w32.to(dtype)), ref)
                with _patched(triton_w4a16, AWQ_GEMV_M=8):
                    got = triton_w4a16.w4a16_gemm(x, qw, s, z, None, "awq", 4, gs, **kw)
                    again = triton_w4a16.w4a16_gemm(x, qw, s, z, None, "awq", 4, gs, **kw)
                rel = _rel(got, ref)
                checks.append(dict(K=K, N=N, M=M, path=path, dtype=str(dtype).split(".")[-1], rel_err=rel,
                                   torch_rel_err=torch_rel, deterministic=bool(torch.equal(got, again)),
                                   ok=bool(rel <= max(2e-3 if dtype == torch.float16 else 1.6e-2, 2 * torch_rel))
                                   and bool(torch.equal(got, again))))
        del w32
    print(f"awq_rows checks: {sum(c['ok'] for c in checks)}/{len(checks)} ok", flush=True)
    for c in checks:
        if not c["ok"]:
            print("  not ok:", c, flush=True)
    res["awq_rows_correct"] = checks
    for K, N in SHAPES:
        copies, ws = _cold_awq_and_bf16(K, N, dev, cold_bytes)
        for M in AWQ_ROWS_MS:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

            def awq(_c=copies, _x=x, _exact=True, **kw):
                with _patched(triton_w4a16, AWQ_EXACT=_exact, AWQ_GEMV_M=4):
                    for c in _c:
                        triton_w4a16.w4a16_gemm(_x, *c, None, "awq", 4, GROUP, **{"dequant_m": 1 << 30, **kw})

            def bf16(_ws=ws, _x=x):
                for w in _ws:
                    torch.nn.functional.linear(_x, w)

            def each(f, n=len(copies)):
                return time_ms(f, dev, iters=4)[0] / n

            row = dict(K=K, N=N, M=M, bf16_ms=each(bf16, len(ws)), tile_old_ms=each(partial(awq, _exact=False,
                                                                                              block_m=16)),
                       tile_exact_ms=each(partial(awq, block_m=16)),
                       dequant_cublas_ms=each(partial(awq, dequant_m=1)))
            if M <= 4:
                row["gemv_ms"] = each(awq)
            timed = []
            for cfg in grid if M <= 16 else []:
                try:
                    timed.append((each(partial(awq, **cfg)), cfg))
                except Exception:  # out of shared memory etc.
                    continue
            timed.sort(key=lambda t: t[0])
            row["best"] = [dict(ms=t, **c) for t, c in timed[:4]]
            rows.append(row)
            print(f"awq rows {K}x{N} M={M}: bf16 {row['bf16_ms']:.4f}, gemv {row.get('gemv_ms', 0):.4f}, tile old "
                  f"{row['tile_old_ms']:.4f}, exact {row['tile_exact_ms']:.4f}, dequant+cuBLAS "
                  f"{row['dequant_cublas_ms']:.4f}, best {timed[0] if timed else None}", flush=True)
        del copies, ws
    res["awq_rows"] = rows


def _decode_batches(res: dict, base: dict, runs: list) -> None:
    """For each (batch, quantization, tag, {triton_w4a16 attribute: value}) of runs, in this process: that many
    requests, prompts of 128 random tokens, 512 new tokens each, with the attributes set."""
    from h200_engine import run_vserve, workload

    from vserve.kernels import triton_w4a16

    for b, q, tag, attrs in runs:
        p, o = workload(b, 3, base["vocab_size"], (512, 512), in_len=(128, 128))
        with _patched(triton_w4a16, **attrs):
            r = res[f"b{b}_in128_out512_{q}{tag}"] = _drop_plan(run_vserve(_model_cfg(base, q), p, o,
                                                                           max_num_seqs=max(8, b),
                                                                           enforce_eager=False))
        print(f"batch {b} {q}{tag}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_awq_rows_e2e(res: dict, base: dict) -> None:
    """Decode at batch 1, 2, 4, 8 and 16 (that many requests, prompts of 128 random tokens, 512 new tokens each):
    bf16, AWQ as shipped, AWQ with rows from 2 on through the tile kernel's old dequantization and launches (as
    before this change), and at batch 2 AWQ through the exact tile path instead of the GEMV, in this process (an AWQ
    warm-up run first)."""
    from vserve.kernels import triton_w4a16

    orig = triton_w4a16._config

    def before(M, N, K, device, layout=""):  # the generic launches beyond one row, as before this change
        return orig(M, N, K, device, layout if M == 1 else "")

    # (no arrival counts: the tile kernel's split partials summed by a second kernel; batches of 2 and more never
    # reach the one-row GEMV, which also takes them)
    old = dict(AWQ_GEMV_M=1, AWQ_EXACT=False, _config=before, arrival_counts=lambda device, n: None)
    runs = [(1, "awq", "warmup", {}), (1, "bf16", "", {}), (1, "awq", "", {})]
    for b in (2, 4, 8, 16):
        runs += [(b, "bf16", "", {}), (b, "awq", "", {}), (b, "awq", "_before", old)]
    runs += [(2, "awq", "_tile", dict(AWQ_GEMV_M=1))]
    _decode_batches(res, base, runs)


def section_awq_rows_e2e2(res: dict, base: dict) -> None:
    """Decode at batch 3, 24 and 48 (as section_awq_rows_e2e): bf16, AWQ as shipped, AWQ at batch 3 through the GEMV
    (AWQ_GEMV_M = 3) and at 24 and 48 with the old dequantize + cuBLAS thresholds (24 rows, 96 for gate_up)."""
    runs = [(3, "bf16", "", {}), (3, "awq", "", {}), (3, "awq", "_gemv", dict(AWQ_GEMV_M=3))]
    for b in (24, 48):
        runs += [(b, "bf16", "", {}), (b, "awq", "", {}), (b, "awq", "_old_dequant_m",
                                                         dict(DEQUANT_M=24, DEQUANT_M_WIDE=96))]
    _decode_batches(res, base, runs)


def section_awq_fixup_e2e(res: dict, base: dict) -> None:
    """Decode at batch 4, 8 and 16 (as section_awq_rows_e2e): bf16, AWQ as shipped (the tile kernel's split partials
    summed by its last program per output tile), AWQ with them summed by a second kernel (no arrival counts), in
    this process."""
    runs = []
    for b in (4, 8, 16):
        runs += [(b, "bf16", "", {}), (b, "awq", "", {}), (b, "awq", "_two_kernels",
                                                         dict(arrival_counts=lambda device, n: None))]
    _decode_batches(res, base, runs)


def section_small_partition(res: dict, base: dict, splits=(128, 64, 32)) -> None:
    """Batch-1 decode of bf16 and AWQ with decode attention's partitions set by each of splits
    (triton_attention.SMALL_SPLITS: 64, 128 and 256 tokens over this shape's 8192-token block tables), each engine
    twice."""
    from vserve.kernels import triton_attention

    for rep in ("", "_again"):
        for n in splits:
            size = 8192 // n
            with _patched(triton_attention, SMALL_SPLITS=n):
                section_bs1_awq(res, base, [(f"partition_bs1_{q}_{size}{rep}", q, None, {}) for q in ("bf16", "awq")])


def section_pdl(res: dict, base: dict) -> None:
    """Batch-1 decode of bf16 and AWQ with and without programmatic dependent launch (triton_ops.PDL), each engine
    twice (alternated; the first AWQ run of a process is a warm-up)."""
    eng = []
    for rep in ("", "_again"):
        eng += [(f"pdl_bs1_{q}_pdl{int(pdl)}{rep}", q, None, {"ops.PDL": pdl}) for q in ("bf16", "awq")
                for pdl in (False, True)]
    section_bs1_awq(res, base, eng)


def section_fp8mm(res: dict, dev: str, shapes, ms=(256, 2048)) -> None:
    """FP8 W8A8 linear: the per-token quantizer alone, torch._scaled_mm with and without use_fast_accum, and the
    whole fp8_linear both ways, beside bf16 F.linear; the error of each against fp8_linear_ref."""
    from vserve.kernels import scaled_mm, triton_ops
    from vserve.kernels.gpu_check import time_ms

    rows, default = [], scaled_mm.FAST_ACCUM
    for K, N in shapes:
        wq, ws = w8_weight("fp8", K, N, dev)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, xs = triton_ops.per_token_quant(x, torch.float8_e4m3fn)
            ref = scaled_mm.fp8_linear_ref(x, wq, ws)
            row = dict(K=K, N=N, M=M, bf16_ms=time_ms(partial(torch.nn.functional.linear, x, w), dev)[0],
                       quant_ms=time_ms(partial(triton_ops.per_token_quant, x, torch.float8_e4m3fn), dev)[0])
            for fast in (False, True):
                tag = "fast" if fast else "exact"
                mm = partial(torch._scaled_mm, xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1),
                             out_dtype=torch.bfloat16, use_fast_accum=fast)
                row[f"scaled_mm_{tag}_ms"] = time_ms(mm, dev)[0]
                scaled_mm.FAST_ACCUM = fast
                try:
                    row[f"fp8_linear_{tag}_ms"] = time_ms(partial(scaled_mm.fp8_linear, x, wq, ws), dev)[0]
                    row[f"fp8_linear_{tag}_rel_err"] = _rel(scaled_mm.fp8_linear(x, wq, ws), ref)
                finally:
                    scaled_mm.FAST_ACCUM = default
            row["tflops_fast"] = 2 * M * K * N / (row["scaled_mm_fast_ms"] * 1e-3) / 1e12
            rows.append(row)
            print(f"fp8mm {K}x{N} M={M}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                        if k not in ("K", "N", "M")), flush=True)
    res["fp8mm"] = rows


FP8_SPLITK_GRID = [dict(block_m=bm, block_n=bn, block_k=128, split_k=sk, num_warps=w, num_stages=st)
                   for bm, bn, w, st in ((64, 128, 4, 4), (128, 128, 8, 4), (64, 64, 4, 5), (128, 64, 4, 4),
                                         (128, 256, 8, 3))
                   for sk in (1, 2, 4, 7)]


TUNE_GRID = [dict(block_m=bm, block_n=bn, block_k=128, split_k=sk, num_warps=w, num_stages=st)
             for bm, bn, w, st in ((64, 128, 4, 4), (64, 64, 4, 5), (128, 128, 8, 4), (128, 64, 4, 4))
             for sk in (1, 2, 4, 8)]
TUNE_MS = (16, 32, 64, 128, 192, 256)
# cold tuning: the graph batch sizes up to 256 (core/model_runner.graph_batch_sizes), and 256-wide K steps too
COLD_GRID = TUNE_GRID + [dict(block_m=64, block_n=bn, block_k=256, split_k=sk, num_warps=4, num_stages=st)
                         for bn, st in ((64, 4), (128, 3)) for sk in (1, 2, 4, 8)]
COLD_MS = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# swapped tiles (the weight rows on the dot's wide side), up to SWAP_MAX_M rows: 2 programs an SM where they fit
SWAP_GRID = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=st, swap=True)
             for bm, bn, bk, st in ((16, 64, 256, 4), (16, 64, 128, 8), (16, 128, 256, 3), (32, 64, 256, 4),
                                    (32, 64, 128, 6), (32, 128, 128, 4))
             for sk in (1, 2, 4, 8)]
SWAP_MAX_M = 128


def _fp8_weight_copies(K: int, N: int, dev: str, cold_bytes: int) -> list:
    """FP8 [N, K] weights with their channel scales: one, or at least cold_bytes of copies, so that cycling through
    them finds each out of L2, as a decode step finds its layers' weights."""
    return [w8_weight("fp8", K, N, dev) for _ in range(max(1, -(-cold_bytes // (K * N))))]


def _ms_per_weight(gemm, copies: list, dev: str, iters: int) -> float:
    """ms per call of gemm(weight, scale), timed over a CUDA graph of iters passes through copies."""
    from vserve.kernels.gpu_check import time_ms

    return time_ms(lambda: [gemm(w, s) for w, s in copies], dev, iters=iters)[0] / len(copies)


def tune_fp8_splitk(res: dict, dev: str, shapes, ms=TUNE_MS, grid=TUNE_GRID, key: str = "fp8_splitk",
                    margin: float = 0.97, cold_bytes: int = 0) -> dict:
    """For each shape and row count, torch._scaled_mm (as the engine runs it) against the split-K launches of grid
    (CUDA-graph timing, bf16 outputs), each launch's error against fp8_mm_ref; the table scaled_mm.FP8_SPLITK takes:
    for each row count, (rows, the best launch) where it takes under margin x cuBLAS's time, else (rows, None), a
    launch serving the row counts down to the previous entry (runs of one choice merged). cold_bytes 0: one weight,
    hot in L2 as in any one-GEMM timing; else each timed call cycles through copies of the weight (at least
    cold_bytes of them), so that, as in a decode step, none is still in L2. Rows and table go to res[key + "_tune"]
    and res[key + "_table"]."""
    from vserve.kernels import scaled_mm, triton_fp8_mm, triton_ops

    saved, scaled_mm.FP8_SPLITK = scaled_mm.FP8_SPLITK, {}
    rows, table = [], {}
    try:
        for K, N in shapes:
            copies = _fp8_weight_copies(K, N, dev, cold_bytes)
            wq, ws = copies[0]

            def each(f, xq, xs, out_dtype, _c=copies, **kw):  # ms per GEMM f(xq, xs, weight, scale, out_dtype)
                return _ms_per_weight(lambda w, s: f(xq, xs, w, s, out_dtype, **kw), _c, dev,
                                      2 if cold_bytes else 20)

            entries = []
            for M in ms:
                xq, xs = triton_ops.per_token_quant(torch.randn(M, K, device=dev, dtype=torch.bfloat16),
                                                    torch.float8_e4m3fn)
                ref = scaled_mm.fp8_mm_ref(xq, xs, wq, ws, torch.bfloat16)
                cublas = each(scaled_mm.fp8_mm, xq, xs, torch.bfloat16)
                best = None
                for cfg in grid:
                    if K % (cfg["split_k"] * cfg["block_k"]) or (cfg.get("swap") and M > SWAP_MAX_M):
                        continue
                    try:
                        err = _rel(triton_fp8_mm.fp8_mm_splitk(xq, xs, wq, ws, torch.bfloat16, **cfg), ref)
                        t = each(triton_fp8_mm.fp8_mm_splitk, xq, xs, torch.bfloat16, **cfg)
                    except Exception as e:  # a launch that does not fit: keep the others
                        rows.append(dict(K=K, N=N, M=M, cfg=cfg, error=str(e)[:200]))
                        continue
                    rows.append(dict(K=K, N=N, M=M, cfg=cfg, ms=t, cublas_ms=cublas, rel_err=err))
                    if err < 2e-2 and (best is None or t < best[0]):
                        best = (t, cfg)
                won = best is not None and best[0] < margin * cublas
                if entries and entries[-1][1] == (best[1] if won else None):
                    entries.pop()  # the same choice as the row count below: one entry serves both
                entries.append((M, best[1] if won else None))
                print(f"fp8_splitk {K}x{N} M={M}: cublas {cublas:.4f} ms, best split-K "
                      + (f"{best[0]:.4f} ms {best[1]}" if best else "none") + (" (taken)" if won else ""), flush=True)
            while entries and entries[-1][1] is None:  # past the last entry is cuBLAS anyway
                entries.pop()
            if entries:
                table[(K, N)] = tuple(entries)
            del copies
    finally:
        scaled_mm.FP8_SPLITK = saved
    res[f"{key}_tune"] = rows
    res[f"{key}_table"] = {f"{K}x{N}": v for (K, N), v in table.items()}
    print(f"{key} table: {table}", flush=True)
    return table


def section_fp8mm_swap(res: dict, dev: str, shapes, ms=(64, 96, 128, 160, 192, 224, 256),
                       cold_bytes: int = 256 << 20) -> None:
    """cuBLAS's FP8 GEMM with its operands swapped (W Xᵀ, the [N, M] output then copied back to a contiguous
    [M, N]) against the plain call, both as scaled_mm.fp8_mm calls it (row-wise scales, fast accumulation, bf16 out),
    timed cycling through cold_bytes of weight copies (cold, as in a decode step), with the error of each against
    fp8_mm_ref: whether the tokens on cuBLAS's N side avoid its jump to two 128-row tiles past 128 rows."""
    from vserve.kernels import scaled_mm, triton_ops

    rows = []
    for K, N in shapes:
        copies = _fp8_weight_copies(K, N, dev, cold_bytes)
        for M in ms:
            xq, xs = triton_ops.per_token_quant(torch.randn(M, K, device=dev, dtype=torch.bfloat16),
                                                torch.float8_e4m3fn)

            def plain(w, s, _x=xq, _xs=xs):
                return torch._scaled_mm(_x, w.t(), scale_a=_xs, scale_b=s.reshape(1, -1), out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

            def swapped(w, s, _x=xq, _xs=xs):
                return torch._scaled_mm(w, _x.t(), scale_a=s.reshape(-1, 1), scale_b=_xs.reshape(1, -1),
                                        out_dtype=torch.bfloat16, use_fast_accum=True).t().contiguous()

            ref = scaled_mm.fp8_mm_ref(xq, xs, *copies[0], torch.bfloat16)
            row = dict(K=K, N=N, M=M)
            for name, f in (("plain", plain), ("swapped", swapped)):
                row[f"{name}_rel_err"] = _rel(f(*copies[0]), ref)
                row[f"{name}_ms"] = _ms_per_weight(f, copies, dev, 2)
            rows.append(row)
            print(f"fp8mm_swap {K}x{N} M={M}: plain {row['plain_ms']:.4f} ms, swapped {row['swapped_ms']:.4f} ms "
                  f"(errors {row['plain_rel_err']:.2e}, {row['swapped_rel_err']:.2e})", flush=True)
        del copies
    res["fp8mm_swap"] = rows


def section_fp8_splitk(res: dict, base: dict, cold: bool = False) -> None:
    """Tune the split-K table on this GPU (tune_fp8_splitk), then the throughput workload. Hot (run 13): FP8 W8A8 +
    fp8 KV with cuBLAS only (first: it also takes the process's first-run compiles), bf16, FP8 with the table, FP8
    without. cold (weights cycled out of L2 while timing): one untimed-for-the-ratio run of each model, then bf16,
    FP8 with the shipped table and FP8 with the cold-tuned one, alternated twice."""
    from vserve.kernels import scaled_mm

    saved = scaled_mm.FP8_SPLITK
    if cold:
        table = tune_fp8_splitk(res, "cuda", SHAPES, COLD_MS, COLD_GRID + SWAP_GRID, "fp8_splitk_cold",
                                cold_bytes=256 << 20)
        runs = [("warm", "fp8", "fp8", None), ("warm", "bf16", "auto", None)] + [
            ("_".join(filter(None, (lbl, f"r{i}"))), q, kv, t) for i in (1, 2)
            for lbl, q, kv, t in (("", "bf16", "auto", None), ("shipped", "fp8", "fp8", None),
                                  ("cold", "fp8", "fp8", table))]
    else:
        table = tune_fp8_splitk(res, "cuda", SHAPES)
        runs = [("warm_cublas", "fp8", "fp8", {}), ("", "bf16", "auto", None), ("splitk", "fp8", "fp8", table),
                ("cublas", "fp8", "fp8", {}), ("splitk_r2", "fp8", "fp8", table)]
    for label, q, kv, t in runs:
        scaled_mm.FP8_SPLITK = saved if t is None else t
        try:
            r = res[f"throughput_256_u100_1024_{q}_kv_{kv}" + (f"_{label}" if label else "")] = _run_256(base, q, kv)
        finally:
            scaled_mm.FP8_SPLITK = saved
        print(f"{q} {label}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_throughput_fast(res: dict, base: dict) -> None:
    """256 requests: FP8 W8A8 + fp8 KV with use_fast_accum and without it, beside bf16 (this process)."""
    from vserve.kernels import scaled_mm

    section_throughput(res, base, (("bf16", "auto"),))
    default = scaled_mm.FAST_ACCUM
    for fast in (False, True):
        scaled_mm.FAST_ACCUM = fast
        try:
            res["throughput_256_u100_1024_fp8_kv_fp8" + ("_fast_accum" if fast else "_exact_accum")] = _run_256(
                base, "fp8", "fp8")
        finally:
            scaled_mm.FAST_ACCUM = default


def decode_config(cfg: dict | None):
    """Run the engine's decode attention with launch overrides cfg (None: the defaults) from the next model on."""
    from vserve import kernels
    from vserve.kernels import triton_attention as tri

    orig = getattr(tri.paged_decode_attention, "__wrapped__", tri.paged_decode_attention)
    tri.paged_decode_attention = partial(orig, **cfg) if cfg else orig
    if cfg:
        tri.paged_decode_attention.__wrapped__ = orig
    kernels._triton.cache_clear()  # the op table holds the function it found first


def section_throughput_attn(res: dict, base: dict, sweep: Path) -> None:
    """256 requests, bf16 and FP8 W8A8 + fp8 KV, each with the default decode launch and with the fastest one of
    benchmarks/decode_sweep.py's B=240 case for its cache dtype (sweep: its JSON)."""
    best = json.loads(sweep.read_text())["best"]
    for q, kv, key in (("bf16", "auto", "bf16"), ("fp8", "fp8", "fp8")):
        cfg = next((v["cfg"] for k, v in best.items() if k.startswith(f"{key} B=240")), "default")
        for label, c in (("default", None), ("tuned", cfg if cfg != "default" else None)):
            if label == "tuned" and c is None:
                continue  # no sweep for this cache dtype, or its default won
            r = _run_256(base, q, kv, c)
            res[f"throughput_256_u100_1024_{q}_kv_{kv}_decode_{label}"] = dict(r, decode_cfg=c)
            print(f"{q} kv {kv} decode {label} {c}: {r['output_tok_s']:.1f} tok/s", flush=True)


def section_profile(res: dict, out: Path, base: dict, label: str, quant: str, kv: str, n: int, in_len, out_len,
                    first: int, steps: int = 10) -> None:
    """Kernel time by name over `steps` engine steps from step `first` (CUDA activity only, CUDA graphs replay as
    in a run), beside the steps' wall time; the table goes to OUT/profile_LABEL.txt."""
    from h200_engine import free_gpu, model_dir, profile_steps, workload

    from vserve import LLM, SamplingParams

    p, o = workload(n, 0, base["vocab_size"], out_len, in_len=in_len)
    llm = LLM(model_dir(_model_cfg(base, quant)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=max(8, n), enforce_eager=False, kv_cache_dtype=kv)
    llm.generate(p[:1], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    eng = llm.llm_engine
    prof, wall, batch = profile_steps(eng, p, o, first, steps)
    ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in ka) / 1e3  # ms
    try:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
    except Exception:  # an older torch's key
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    (out / f"profile_{label}.txt").write_text(table)
    res[f"profile_{label}"] = dict(
        steps=steps, batch=batch, wall_ms_per_step=1e3 * wall / steps,
        kernel_ms_per_step=busy / steps, top=[(e.key[:90], round(e.self_device_time_total / 1e3 / steps, 4),
                                               e.count // steps) for e in ka[:25]])
    del llm, eng, prof
    free_gpu()


def section_profile_run(res: dict, base: dict, label: str, quant: str, kv: str) -> None:
    """The whole throughput workload (as _run_256) twice: once with a CUDA event at each step's launch (each step's
    span on the GPU, from its start to the next step's start, idle gaps included, beside its shape), once under a
    CUDA-activity profiler (kernel time by name over the whole run). Says where the run's seconds go: prefill
    against decode steps, kernels against idle."""
    from h200_engine import free_gpu, model_dir, workload
    from torch.profiler import ProfilerActivity, profile

    from vserve import LLM, SamplingParams

    p, o = workload(256, 0, base["vocab_size"], (100, 1024))
    # no prefix caching: the profiled pass repeats the prompts (random tokens: the timed pass shares no prefixes)
    llm = LLM(model_dir(_model_cfg(base, quant)), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=256, enforce_eager=False, kv_cache_dtype=kv, enable_prefix_caching=False)
    llm.generate(p[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.runner
    orig, steps = runner.launch, []

    def launch(sched, block_ids):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        dec = sum(1 for n in sched.num_scheduled_tokens if n == 1)
        steps.append((sched.total_tokens, dec, ev, time.perf_counter()))
        return orig(sched, block_ids)

    sps = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True) for n in o]
    runner.launch = launch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(p, sps, use_tqdm=False)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    runner.launch = orig
    evs = [s[2] for s in steps] + [end]
    rows = [(t, d, evs[i].elapsed_time(evs[i + 1]), 1e3 * ((steps[i + 1][3] if i + 1 < len(steps) else t0 + wall) -
                                                          steps[i][3]))
            for i, (t, d, _, _) in enumerate(steps)]
    mixed = [r for r in rows if r[0] > r[1]]
    decode = [r for r in rows if r[0] == r[1]]
    bins = {}
    for _t, d, g, h in decode:
        b = bins.setdefault(min(d // 32 * 32, 256), [0, 0.0, 0.0, 0])
        b[0] += 1
        b[1] += g
        b[2] += h
        b[3] += d
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t1 = time.perf_counter()
        llm.generate(p, sps, use_tqdm=False)
        torch.cuda.synchronize()
        prof_wall = time.perf_counter() - t1
    ka = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    # the run's mixed (prefill) steps come first: kernels that start within their span of the first kernel
    kern = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    first = min((k[1] for k in kern), default=0)
    span_us = 1e3 * sum(r[2] for r in rows[:next((i for i, r in enumerate(rows) if r[0] == r[1]), len(rows))])
    pre: dict[str, list] = {}
    for name, start, us in kern:
        if start - first < span_us:
            c = pre.setdefault(name[:120], [0.0, 0])
            c[0] += us / 1e6
            c[1] += 1
    res[f"profile_run_{label}"] = dict(
        prefill_phase_ms=span_us / 1e3, prefill_kernel_s=sum(c[0] for c in pre.values()),
        prefill_kernels=sorted(((n, c[0], c[1]) for n, c in pre.items()), key=lambda x: -x[1])[:60],
        wall_s=wall, steps=len(rows), output_tok_s=sum(o) / wall,
        mixed_steps=dict(n=len(mixed), gpu_ms=sum(r[2] for r in mixed), host_ms=sum(r[3] for r in mixed),
                         tokens=sum(r[0] for r in mixed), decode_rows=sum(r[1] for r in mixed)),
        decode_steps=dict(n=len(decode), gpu_ms=sum(r[2] for r in decode), host_ms=sum(r[3] for r in decode)),
        decode_by_batch={k: dict(n=v[0], gpu_ms=v[1], host_ms=v[2], mean_batch=v[3] / v[0])
                         for k, v in sorted(bins.items())},
        step_rows=rows, profiled_wall_s=prof_wall,
        kernel_s=sum(e.self_device_time_total for e in ka) / 1e6,
        kernels=[(e.key[:120], e.self_device_time_total / 1e6, e.count) for e in ka if e.self_device_time_total > 0])
    print(f"profile_run {label}: {wall:.2f} s wall, {len(mixed)} mixed steps {sum(r[2] for r in mixed) / 1e3:.2f} s, "
          f"{len(decode)} decode steps {sum(r[2] for r in decode) / 1e3:.2f} s; kernels "
          f"{res[f'profile_run_{label}']['kernel_s']:.2f} s of {prof_wall:.2f} s profiled", flush=True)
    del llm, prof, launch, evs
    runner = orig = None  # the closure's cells: the engine must go before free_gpu
    free_gpu()


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
        if isinstance(v, dict) and "output_tokens" in v:
            lines.append(f"{k}: {v['output_tok_s']:.1f} tok/s ({v['output_tokens']} tokens in {v['seconds']:.1f} s)")
        if k.endswith("_error"):
            lines.append(f"{k}: {str(v).strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="correct,speed,memory,bs1,throughput",
                    help="comma-separated, of correct, speed, sweep, memory, bs1, throughput, throughput_kv, gemv, "
                         "bs1_awq, fp8mm, throughput_fast, throughput_pair, throughput_attn (after decode_sweep.py), "
                         "awq_fixup, awq_gemv, w4_dequant, profile_fp8_256, ...")
    ap.add_argument("--sweep-ms", type=lambda v: [int(m) for m in v.split(",")], default=SWEEP_MS,
                    help="rows timed over the launch grid (sweep), comma-separated")
    ap.add_argument("--fp8mm-ms", type=lambda v: [int(m) for m in v.split(",")], default=[256, 2048],
                    help="rows of the fp8mm section, comma-separated")
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
                    "gemv": lambda r: section_gemv(r, "cpu", TINY_SHAPES[:1], GEMV_GRID[:2]),
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
                                                                                 ("fp8", "fp8"))),
                    "gemv": lambda r: section_gemv(r, "cuda", SHAPES),
                    "gemv_cold": lambda r: section_gemv(r, "cuda", SHAPES, GEMV_COLD_GRID, cold=True),
                    "profile_awq_bs1": lambda r: section_profile(r, out, LLAMA3_8B, "awq_bs1", "awq", "auto", 1,
                                                                 (128, 128), (512, 512), 50),
                    "profile_bf16_bs1": lambda r: section_profile(r, out, LLAMA3_8B, "bf16_bs1", "bf16", "auto", 1,
                                                                  (128, 128), (512, 512), 50),
                    "profile_awq_b2": lambda r: section_profile(r, out, LLAMA3_8B, "awq_b2", "awq", "auto", 2,
                                                                (128, 128), (512, 512), 50),
                    "profile_bf16_b2": lambda r: section_profile(r, out, LLAMA3_8B, "bf16_b2", "bf16", "auto", 2,
                                                                 (128, 128), (512, 512), 50),
                    "profile_fp8_256": lambda r: section_profile(r, out, LLAMA3_8B, "fp8_256", "fp8", "fp8", 256,
                                                                 (100, 1024), (100, 1024), 150),
                    "profile_bf16_256": lambda r: section_profile(r, out, LLAMA3_8B, "bf16_256", "bf16", "auto", 256,
                                                                  (100, 1024), (100, 1024), 150),
                    "profile_run": lambda r: (section_profile_run(r, LLAMA3_8B, "bf16", "bf16", "auto"),
                                              section_profile_run(r, LLAMA3_8B, "fp8", "fp8", "fp8")),
                    "bs1_awq": lambda r: section_bs1_awq(r, LLAMA3_8B),
                    "w4_dequant": lambda r: section_w4_dequant(r, LLAMA3_8B),
                    "w4_dequant_e2e": lambda r: section_w4_dequant_e2e(r, LLAMA3_8B),
                    "awq_fixup": lambda r: section_awq_variants(r, LLAMA3_8B, "awq_fixup", "AWQ_FIXUP_UNROLL", (1, 8),
                                                                GEMV_COLD_GRID_WIDE),
                    "awq_gemv": lambda r: section_awq_gemv(r, LLAMA3_8B),
                    "awq_gemv_default": lambda r: section_awq_gemv(r, LLAMA3_8B, []),
                    "awq_gemv_narrow": lambda r: section_awq_gemv(r, LLAMA3_8B, AWQ_GEMV_NARROW),
                    "awq_gemv_pdl": lambda r: section_awq_gemv(r, LLAMA3_8B, AWQ_GEMV_PDL),
                    "awq_gemv_wide": lambda r: section_awq_gemv(r, LLAMA3_8B, AWQ_GEMV_WIDE),
                    "pdl": lambda r: section_pdl(r, LLAMA3_8B),
                    "awq_rows": lambda r: section_awq_rows(r),
                    "awq_rows_e2e": lambda r: section_awq_rows_e2e(r, LLAMA3_8B),
                    "awq_rows_e2e2": lambda r: section_awq_rows_e2e2(r, LLAMA3_8B),
                    "awq_fixup_e2e": lambda r: section_awq_fixup_e2e(r, LLAMA3_8B),
                    "small_partition": lambda r: section_small_partition(r, LLAMA3_8B),
                    "pdl_check": lambda r: section_pdl_check(r, LLAMA3_8B),
                    "fp8mm": lambda r: section_fp8mm(r, "cuda", SHAPES, args.fp8mm_ms),
                    "fp8mm_triton": lambda r: tune_fp8_splitk(r, "cuda", SHAPES, args.fp8mm_ms, FP8_SPLITK_GRID,
                                                              "fp8mm_triton"),
                    "fp8_splitk": lambda r: section_fp8_splitk(r, LLAMA3_8B),
                    "fp8_splitk_cold": lambda r: section_fp8_splitk(r, LLAMA3_8B, cold=True),
                    "fp8mm_swap": lambda r: section_fp8mm_swap(r, "cuda", SHAPES),
                    "throughput_fast": lambda r: section_throughput_fast(r, LLAMA3_8B),
                    "throughput_pair": lambda r: section_throughput_pair(r, LLAMA3_8B),
                    "throughput_partition": lambda r: section_throughput_partition(r, LLAMA3_8B),
                    "throughput_reduce": lambda r: section_throughput_reduce(r, LLAMA3_8B),
                    "throughput_pair_warm": lambda r: section_throughput_pair_warm(r, LLAMA3_8B),
                    "throughput_attn": lambda r: section_throughput_attn(r, LLAMA3_8B, out / "decode_sweep.json")}
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
