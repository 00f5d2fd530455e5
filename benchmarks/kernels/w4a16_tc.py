"""Issue #31's W4A16 measurements: the tensor-core kernel on the repacked layout (kernels/triton_w4a16_tc.py) beside
today's path, cuBLAS bf16 and gemlite, on Llama-3-8B's four linear shapes, with the weights out of L2 (as a decode
step finds them).

    python benchmarks/kernels/w4a16_tc.py --check --out $OUT     # H100: ~1.5 min
    python benchmarks/kernels/w4a16_tc.py --compare --out $OUT   # ~2.5 min (+ gemlite where importable)
    python benchmarks/kernels/w4a16_tc.py --tune --out $OUT      # ~4 min: OUT/w4a16_configs.json
    python benchmarks/kernels/w4a16_tc.py --tune --compare --out $OUT   # ~6 min: --compare at the tuned launches
    python benchmarks/kernels/w4a16_tc.py --words-ab --rows 1,64,256 --out $OUT   # scales as int32 words vs not
    python benchmarks/kernels/w4a16_tc.py --even-ab --rows 1,128,256 --out $OUT   # no N masks (EVEN_N) vs masks
    ncu --set full ... python benchmarks/kernels/w4a16_tc.py --profile --rows 256 --shapes 4096:28672 --out $OUT
    python benchmarks/kernels/w4a16_tc.py --cpu-smoke --out /tmp/w4tc   # tiny shapes, TRITON_INTERPRET=1

--check: every layout the repack takes (AWQ, GPTQ, GPTQ act-order, compressed-tensors pack) in bf16 (and AWQ in fp16)
at M = 1, 16, 33, 256 and on a shape with tails in N and K (4000 x 4032, groups of 64): the tc kernel as the table or
its defaults launch it, its dequantize + cuBLAS path and, for AWQ and act-order in bf16, its other variants (scales
on the weights; the plain-Triton unpack instead of the PTX), against F.linear on the dequantized weight in fp32:
relative error max|got - ref| / max|ref| within max(the dtype's tolerance, 2x cuBLAS's own error on the weight in
that dtype), and the same bits on a second call (split-K summed in order). gemlite's error is reported, not judged.
--compare: ms per GEMM, TFLOP/s (2 M N K / t) and GB/s (weights + x + y bytes / t) at M = 1 .. 256: `tc` (w4a16_gemm on
the repacked weight, the table's path and launch or the defaults), `today` (w4a16_gemm on the AWQ checkpoint
tensors, as the engine runs them now), `bf16` (F.linear, cuBLAS), `gemlite` (0.6.0.post2 A16W4 HQQ-INT group 128,
its own per-M kernel choice and its bundled H100 configs) where it imports.
--tune: per shape and M bucket, a launch grid of the tc kernel (stage 1: tile shape x split-K at 3 stages, 2 for tiles
whose 3 would not fit shared memory, and at 2 too from 33 to 256 rows; stage 2: the best three at the other depths of
2-4), its dequantize + cuBLAS path and today's path; writes OUT/w4a16_configs.json, the committed table with this
device's entries added: layout "tc" for a shape only where the tc paths are faster over the buckets summed and not
slower at M = 1 (--batch1-slack), each bucket's row the faster of "tc" (its best launch) and "dequant"; rows carry the
measured ms under "_ms". Copy it to kernels/w4a16_configs.json, or point VSERVE_W4A16_CONFIGS at it. With --compare in
the same run, `tc` is timed at the tuned path and launch of each M.
Results: OUT/w4a16_tc.json and a markdown table OUT/w4a16_tc.md. TRITON_CACHE_DIR kept between runs saves the
compiles (most of --tune's time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down of Llama-3-8B
NAMES = {(4096, 6144): "qkv", (4096, 4096): "o", (4096, 28672): "gate_up", (14336, 4096): "down"}
# decode batches, then prefill-sized steps: a row serves up to the next, so without 1024 and up the 256 row's choice
# (tc for gate_up and down on the H100, s27) served every 8,192-token prefill step, where dequantize + cuBLAS runs
# at cuBLAS's ~2x the TFLOP/s for ~4% more time (the dequantize)
# 192: decode graphs of 192-240 rows ran the 128-row launches, and 256-request serving spends half its steps at
# 129-256 rows (session 41)
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 512, 1024, 4096, 8192]
CHECK_ROWS = [1, 16, 33, 256]
GROUP = 128
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def checkpoint(layout: str, K: int, N: int, dev: str, group: int = GROUP):
    """Random valid checkpoint tensors of one [N, K] 4-bit weight: (qweight, scales, qzeros, g_idx, kind)."""
    from vserve.quantize.formats import pack_int32

    def rand32(*shape):
        return torch.randint(-2**31, 2**31, shape, dtype=torch.int64, device=dev).to(torch.int32)

    G = -(-K // group)
    scales = (torch.rand(G, N, device=dev) * 2e-3 + 1e-3).half()
    if layout == "awq":
        return rand32(K, N // 8), scales, rand32(G, N // 8), None, "awq"
    if layout.startswith("gptq"):
        g = torch.arange(K, device=dev, dtype=torch.int32) // group
        return rand32(K // 8, N), scales, rand32(G, N // 8), g[torch.randperm(K, device=dev)] if layout == \
            "gptq-act" else None, "gptq"
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32, device=dev)
    return pack_int32(codes, 4), scales.float().t().contiguous(), None, None, "pack"


def tc_weight(ck, K: int, N: int, group: int = GROUP):
    """The checkpoint tensors repacked: (qweight, scales, qzeros, perm, group_size)."""
    from vserve.kernels.w4a16_repack import repack

    qw, s, z, g, kind = ck
    return repack(qw, s, z, g, kind, 4, group, K, N)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)


# ---- check -------------------------------------------------------------------------------------------------------


def check(dev: str, shapes, rows, smoke: bool) -> list[dict]:
    from vserve.kernels import triton_w4a16, w4a16_ref

    cases = [(K, N, GROUP, lay, dt) for K, N in shapes for lay in ("awq", "gptq", "gptq-act", "pack")
             for dt in ((torch.float16,) if smoke else (torch.bfloat16,) + ((torch.float16,) if lay == "awq" else ()))]
    if not smoke:
        cases += [(4032, 4000, 64, lay, torch.bfloat16) for lay in ("awq", "pack")]  # tails in N and K
    out = []
    for K, N, group, layout, dtype in cases:
        ck = checkpoint(layout, K, N, dev, group)
        tq, ts, tz, perm, gs = tc_weight(ck, K, N, group)
        w32 = w4a16_ref.dequantize_weight(ck[0], ck[1], ck[2], ck[3], ck[4], 4, group)
        for M in rows:
            x = torch.randn(M, K, device=dev).to(dtype)
            ref = torch.nn.functional.linear(x.float(), w32)
            limit = max(TOL[dtype], 2 * rel_err(torch.nn.functional.linear(x, w32.to(dtype)), ref))
            variants = {"tc": {}, "tc_dequant": dict(path="dequant")}
            if layout in ("awq", "gptq-act") and (dtype == torch.bfloat16 or smoke):  # the kernel's other paths
                variants["tc_scale_a"] = dict(scale_a=True)
                variants["tc_wide"] = dict(wide=True)
                if not smoke:
                    variants["tc_triton_unpack"] = dict(asm=False)
            for name, kw in variants.items():
                got = _tc_call(x, tq, ts, tz, perm, gs, **kw)
                same = torch.equal(got, _tc_call(x, tq, ts, tz, perm, gs, **kw))
                err = rel_err(got, ref)
                out.append(dict(path=name, layout=layout, K=K, N=N, group=group, M=M,
                                dtype=str(dtype).removeprefix("torch."), rel_err=err, limit=limit,
                                deterministic=same, ok=bool(err <= limit and same)))
            if layout in ("awq", "gptq-act") and not smoke:  # today's path on the checkpoint's tensors, for scale
                got = triton_w4a16.w4a16_gemm(x, ck[0], ck[1], ck[2], ck[3], ck[4], 4, group)
                out.append(dict(path="today", layout=layout, K=K, N=N, group=group, M=M,
                                dtype=str(dtype).removeprefix("torch."), rel_err=rel_err(got, ref), limit=limit,
                                ok=rel_err(got, ref) <= limit))
            gl = _gemlite(ck, K, N, dtype) if layout == "awq" and group == GROUP and not smoke else None
            if gl is not None:
                out.append(dict(path="gemlite", layout=layout, K=K, N=N, group=group, M=M,
                                dtype=str(dtype).removeprefix("torch."), rel_err=rel_err(gl(x), ref), limit=limit,
                                ok=None))
        bad = [r for r in out if r["ok"] is False and r["K"] == K and r["N"] == N and r["layout"] == layout]
        log(f"check {layout:8s} K={K:<5} N={N:<5} {str(dtype):15s} " + (f"{len(bad)} FAILED" if bad else "ok"))
    return out


def _tc_call(x, tq, ts, tz, perm, gs, path: str = "tc", asm: bool | None = None, scale_a: bool | None = None,
             wide: bool | None = None):
    """w4a16_gemm on the tc layout (the table's launch or the defaults; asm: the kernel's unpack forced)."""
    from vserve.kernels import triton_w4a16, triton_w4a16_tc

    if asm is None:
        return triton_w4a16.w4a16_gemm(x, tq, ts, tz, perm, "tc", 4, gs, path=path, scale_a=scale_a, wide=wide)
    M, K = x.shape
    cfg = triton_w4a16_tc.tc_default_config(M, tq.shape[0], K, torch.cuda.get_device_properties(x.device)
                                            .multi_processor_count)
    out = torch.empty(M, tq.shape[0], dtype=x.dtype, device=x.device)
    return triton_w4a16_tc.tc_gemm(x, tq, ts, tz, perm, gs, out, asm=asm, **cfg)


def _gemlite(ck, K: int, N: int, dtype):
    """gemlite's A16W4 linear of the AWQ checkpoint weight (HQQ-INT: (q - z) s, group 128), or None where gemlite
    does not import."""
    try:
        import gemlite  # noqa: F401
        from gemlite.helper import A16W4_HQQ_INT
    except Exception as e:  # not installed, or no GPU it knows
        _gemlite.missing = f"{type(e).__name__}: {e}"
        return None
    from vserve.quantize.formats import unpack_awq

    q, zeros, scales = unpack_awq(ck[0], ck[2], ck[1])
    return A16W4_HQQ_INT(device=str(ck[0].device), dtype=dtype).from_weights(q.to(torch.uint8), scales.to(dtype),
                                                                              zeros.to(dtype))


_gemlite.missing = None


def _gemlite_setup() -> str | None:
    """gemlite's version and the config cache it runs with (its bundled H100 one where the GPU has none), or None."""
    try:
        import gemlite
    except Exception as e:
        _gemlite.missing = f"{type(e).__name__}: {e}"
        return None
    from gemlite import core

    tag = core.get_default_cache_config()
    if tag is None:  # e.g. the H200: gemlite ships no config for it; its H100 one beats autotuning in a timing run
        tag = str(Path(core.__file__).parent / "configs" / "h100.json")
        gemlite.load_config(tag)
    return f"gemlite {gemlite.__version__}, configs {Path(tag).name}"


# ---- compare -----------------------------------------------------------------------------------------------------


def compare(dev: str, shapes, rows, dtype, cold: int, timing: dict, smoke: bool,
            tuned: dict | None = None) -> list[dict]:
    """tuned: {(K, N, M): (path, launch)} from --tune in the same run (its best tc path and launch at every M, also
    where it left the shape on the checkpoint layout); else the table's or the defaults."""
    from timing import copies, time_ms

    from vserve.kernels import triton_w4a16, w4a16_dispatch

    out = []
    for K, N in shapes:
        awq = copies(lambda K=K, N=N: checkpoint("awq", K, N, dev)[:3], K * N // 2, cold)
        tc = [tc_weight((*c, None, "awq"), K, N) for c in awq]
        bf16 = copies(lambda K=K, N=N: (torch.randn(N, K, device=dev, dtype=dtype) * 0.02,), K * N * 2, cold)
        gl = [] if smoke else [g for g in (_gemlite((*c, None, "awq"), K, N, dtype) for c in awq) if g is not None]
        wbytes = N * K // 2 + (K // GROUP) * N * 2 + (K // GROUP) * N // 2  # codes, fp16 scales, 4-bit zeros
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            io = M * K * 2 + M * N * 2
            row = dict(K=K, N=N, shape=NAMES.get((K, N), f"{K}x{N}"), M=M,
                       tc_path=w4a16_dispatch.choose_tc(x.device, N, K, M)[0])
            path, launch = (tuned or {}).get((K, N, M), (None, {}))
            if path is not None:
                row["tc_path"] = f"{path} (tuned)"
            row["bf16_ms"] = time_ms(partial(torch.nn.functional.linear, x), dev, bf16, **timing)
            row["today_ms"] = time_ms(lambda qw, s, z, _x=x: triton_w4a16.w4a16_gemm(  # today's thresholds, not
                _x, qw, s, z, None, "awq", 4, GROUP, path="auto"), dev, awq, **timing)  # the table's tc launches
            row["tc_ms"] = time_ms(lambda qw, s, z, p, gs, _x=x, _kw=dict(launch, path=path): triton_w4a16.w4a16_gemm(
                _x, qw, s, z, p, "tc", 4, gs, **_kw), dev, tc, **timing)
            if gl:
                row["gemlite_ms"] = time_ms(lambda g, _x=x: g(_x), dev, [(g,) for g in gl], **timing)
            for k in [k for k in row if k.endswith("_ms")]:
                name = k.removesuffix("_ms")
                row[f"{name}_TFLOPs"] = 2 * M * N * K / (row[k] * 1e-3) / 1e12
                row[f"{name}_GBps"] = ((N * K * 2 if name == "bf16" else wbytes) + io) / (row[k] * 1e-3) / 1e9
            row["tc_vs_bf16"] = row["bf16_ms"] / row["tc_ms"]
            row["tc_vs_today"] = row["today_ms"] / row["tc_ms"]
            out.append(row)
            log(f"{row['shape']:8s} M={M:<4} " + "  ".join(f"{k.removesuffix('_ms')} {v:.4f}" for k, v in row.items()
                                                            if k.endswith("_ms"))
                + f"  tc/bf16 {row['tc_vs_bf16']:.2f}x  tc/today {row['tc_vs_today']:.2f}x ({row['tc_path']})")
        del awq, tc, bf16, gl
    return out


def _sms(dev: str) -> int:
    """The GPU's SM count (what tc_default_config fills), 4 for the CPU smoke."""
    return torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4


def _ab_cell(c: dict) -> str:
    """One launch of an A/B row as the log shows it: [tile, split, warps, stages, flags] and its ms or the error."""
    flags = (" wide" if c.get("wide") else "") + (" words" if c.get("scale_words") else "") + \
        (" even" if c.get("even_n") else "")
    time = (f"{c['ms']:.4f}" + ("" if c["ok"] else " BAD")) if "ms" in c else "error"
    return f"[{c['block_n']}x{c['block_m']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}{flags}] {time}"


def _table_launch(dev: str, M: int, N: int, K: int, sms: int) -> tuple[str, dict, dict]:
    """The table's path and launch keywords for M rows through an [N, K] tc weight, and the launch w4a16_gemm runs
    there: tc_default_config's keywords with the table's over them."""
    from vserve.kernels import triton_w4a16_tc, w4a16_dispatch

    path, launch = w4a16_dispatch.choose_tc(torch.device(dev), N, K, M)
    return path, launch, dict(triton_w4a16_tc.tc_default_config(M, N, K, sms), **launch)


def _tile_128(M: int, stages: int) -> dict:
    """One 128 x min(M, 128) tile of 4 warps, scales on the weights, wide (at 2 stages two such programs share an
    SM)."""
    return dict(block_n=128, block_m=min(128, M), split_k=1, num_warps=4, num_stages=stages, scale_a=True, wide=True)


def launch_ab(dev: str, shapes, rows, dtype, cold: int, timing: dict, key: str) -> list[dict]:
    """The kernel with and without a launch keyword (key: wide, the one K = 128 dot a tile; scale_words, the
    16-bit scales read as int32 words the pipeline prefetches; or even_n, no masks along N) at the same launches
    (the table's or the defaults', and for 64 rows and up one 128 x min(M, 128) tile of 4 warps at 2 and 3 stages),
    against cuBLAS bf16 on the same weight; each launch's result checked against F.linear on the fp32 dequantized
    weight (the --check tolerance)."""
    from timing import copies, time_ms

    from vserve.kernels import triton_w4a16_tc, w4a16_ref

    sms = _sms(dev)
    out = []
    for K, N in shapes:
        awq = copies(lambda K=K, N=N: checkpoint("awq", K, N, dev)[:3], K * N // 2, cold)
        tc = [tc_weight((*c, None, "awq"), K, N) for c in awq]
        w32 = w4a16_ref.dequantize_weight(awq[0][0], awq[0][1], awq[0][2], None, "awq", 4, GROUP)
        bf16 = copies(lambda K=K, N=N: (torch.randn(N, K, device=dev, dtype=dtype) * 0.02,), K * N * 2, cold)
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            o = torch.empty(M, N, device=dev, dtype=dtype)
            ref = torch.nn.functional.linear(x.float(), w32)
            limit = max(TOL[dtype], 2 * rel_err(torch.nn.functional.linear(x, w32.to(dtype)), ref))
            base = _table_launch(dev, M, N, K, sms)[2]
            launches = [dict(base, **{key: False}), dict(base, **{key: True})]
            if M >= 64:
                launches += [dict(_tile_128(M, st), **{key: v}) for st in (2, 3) for v in (False, True)]
            row = dict(shape=NAMES.get((K, N), f"{K}x{N}"), K=K, N=N, M=M, limit=limit,
                       bf16_ms=time_ms(partial(torch.nn.functional.linear, x), dev, bf16, **timing), launches=[])
            for cfg in launches:
                def run(qw, s, z, p, gs, _cfg=cfg, _x=x, _o=o):
                    return triton_w4a16_tc.tc_gemm(_x, qw, s, z, p, gs, _o, **_cfg)
                try:
                    ms = time_ms(run, dev, tc, **timing)
                    err = rel_err(run(*tc[0]), ref)
                except Exception as e:  # out of shared memory or registers
                    row["launches"].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:100]}"))
                    continue
                row["launches"].append(dict(cfg, ms=ms, rel_err=err, ok=err <= limit,
                                            TFLOPs=2 * M * N * K / (ms * 1e-3) / 1e12))
            out.append(row)
            log(f"{key}-ab {row['shape']:8s} M={M:<4} bf16 {row['bf16_ms']:.4f}  "
                + "  ".join(_ab_cell(c) for c in row["launches"]))
        del awq, tc, bf16, w32
    return out


def profile_launches(dev: str, shapes, rows, dtype, launches: list[dict] | None = None) -> list[dict]:
    """For a profiler (Nsight Compute: `run.sh w4ncu`): per shape and row count, the tc kernel at the table's launch
    and at `launches` (default: one 128 x min(M, 128) tile of 4 warps at 2 stages, two of which share an SM, and one
    256 x 128 tile of 8 warps at 3), each called once, and cuBLAS bf16 on the same shape; nothing timed (ncu replays
    each launch for its counters, and its default cache control flushes L2 first, so the weights come from HBM as in
    a decode step). The list, in launch order, is what the report's kernels are."""
    from vserve.kernels import triton_w4a16_tc

    sms = _sms(dev)
    order = []
    for K, N in shapes:
        tc = tc_weight(checkpoint("awq", K, N, dev), K, N)
        w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
        shape = NAMES.get((K, N), f"{K}x{N}")
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            o = torch.empty(M, N, device=dev, dtype=dtype)
            path, launch, table = _table_launch(dev, M, N, K, sms)
            extra = launches if launches is not None else [
                _tile_128(M, 2), dict(block_n=256, block_m=128, split_k=1, num_warps=8, num_stages=3, scale_a=True,
                                      wide=True)]
            named = [("table" if launch else "defaults (not in the table)" if path == "tc" else
                      f"defaults (the table: {path})", table)]
            for name, cfg in named + [(f"launch {i}", c) for i, c in enumerate(extra)]:
                order.append(dict(shape=shape, M=M, what=name, launch=cfg))
                try:
                    triton_w4a16_tc.tc_gemm(x, *tc, o, **cfg)
                except Exception as e:  # out of shared memory or registers
                    order[-1]["error"] = f"{type(e).__name__}: {str(e)[:100]}"
            torch.nn.functional.linear(x, w)
            order.append(dict(shape=shape, M=M, what="cuBLAS bf16 (F.linear)"))
            if dev == "cuda":
                torch.cuda.synchronize()
        del tc, w
    for r in order:
        log(f"profile {r['shape']:8s} M={r['M']:<4} {r['what']}: {r.get('launch', '')} {r.get('error', '')}")
    return order


# ---- tune --------------------------------------------------------------------------------------------------------


def stages(block_n: int, block_m: int) -> int:
    """The software pipeline's depth for a tile: 3, or 2 where three stages of x^T's [128, block_m] bf16 slice and
    the weight's [block_n, 16] words pass 190 KB of shared memory (Triton asks for more than the stages: on the
    H100 a 128 x 256 tile at 3 stages needed 246,784 bytes of the 232,448 there are; at 2 it fits)."""
    return 3 if 3 * (128 * block_m * 2 + block_n * 16 * 4) <= 190 * 1024 else 2


def grid(M: int, N: int, K: int, sms: int, group: int = GROUP) -> list[dict]:
    """Stage 1 of the launch grid for M rows: tile shapes (rows per tile from M's bucket, 64 to 256 outputs, 4 or 8
    warps, scales on the weights from 64-row tiles) x split-K around what fills the GPU twice over (as
    tc_default_config; from a quarter to four times it up to 16 rows, where the weight's bandwidth is all), at 3
    stages (2: stages()), and from 33 to 256 rows at 2 stages too (a smaller footprint in shared memory, so that two
    programs may share an SM and one unpacks while the other's dot runs); for groups of 128 and up each tile's 8
    fields make one K = 128 dot (wide: on sm_90 a chain of wgmma instructions with one wait a tile; stage 2 times the
    best launches without it too). 129-256 rows: tiles of 64 and 128 rows (256-row tiles timed slower at every
    shape on the H100, session 41). Prefill-sized M (over 256): three tile shapes and no split (the tiles fill the
    GPU)."""
    bms = [16] if M <= 16 else [32] if M <= 32 else [64] if M <= 64 else [64, 128]
    k_tiles, out = -(-K // 128), []
    for bm in bms:
        for bn, warps in ((128, 4), (128, 8), (256, 8)) if M > 256 else ((64, 4), (128, 4), (128, 8), (256, 8)):
            tiles, s0 = -(-N // bn) * -(-M // bm), 1
            while tiles * s0 < 2 * sms and k_tiles // (s0 * 2) >= 2 and 16 * M * s0 * 2 <= K:
                s0 *= 2
            near = {s0 // 4, s0 // 2, s0, s0 * 2, s0 * 4} if M <= 16 else {s0 // 2, s0, s0 * 2} if M <= 256 else {1}
            for split in sorted({max(1, s) for s in near}):
                if split == 1 or split <= k_tiles // 2:
                    for st in sorted({stages(bn, bm)} | ({2} if 32 < M <= 256 else set())):
                        out.append(dict(block_n=bn, block_m=bm, split_k=split, num_warps=warps, num_stages=st,
                                        scale_a=bm >= 64, wide=group >= 128))
    return out


def _compile(dev: str, dtype: torch.dtype, jobs: list[tuple[int, int, dict]]) -> int:
    """Run the tc kernel once for each (K, N, launch) on one row of random data: in a worker process, this compiles
    each launch into Triton's cache on disk, which the tuning process then loads instead of compiling. The count."""
    from vserve.kernels import triton_w4a16_tc

    weights: dict = {}
    for K, N, cfg in jobs:
        if (K, N) not in weights:
            weights[(K, N)] = tc_weight((*checkpoint("awq", K, N, dev)[:3], None, "awq"), K, N)
        x = torch.randn(1, K, device=dev, dtype=dtype)
        try:
            triton_w4a16_tc.tc_gemm(x, *weights[(K, N)], torch.empty(1, N, device=dev, dtype=dtype), **cfg)
        except Exception as e:  # out of shared memory or registers: the tune logs it when it times the launch
            log(f"  compile {cfg}: {type(e).__name__}")
    return len(jobs)


def precompile(pool: tuple | None, dev: str, dtype: torch.dtype, jobs: list[tuple[int, int, dict]]) -> None:
    """The launches' compiles spread over pool's worker processes (Triton compiles one kernel at a time in a process;
    most of a tune's time on one process), one launch once; pool: (executor, its number of processes), or None:
    nothing (they compile when first timed)."""
    seen, todo = set(), []
    for K, N, cfg in jobs:
        key = (K % 128 == 0, N % cfg["block_n"] == 0, tuple(sorted(cfg.items())))  # the variant's EVEN_K, EVEN_N
        if key not in seen:
            seen.add(key)
            todo.append((K, N, cfg))
    if pool is None or not todo:
        return
    t = time.time()
    executor, n = pool
    sum(executor.map(partial(_compile, dev, dtype), [todo[i::n] for i in range(n)]))
    log(f"precompiled {len(todo)} launches in {time.time() - t:.1f}s on {n} processes")


def tune(dev: str, shapes, rows, dtype, cold: int, timing: dict, slack: float,
         save: Path | None = None, merge: bool = False, pool: tuple | None = None) -> tuple[dict, list[dict]]:
    """save: where the table is written after each shape (a run cut short keeps the shapes it finished). merge: the
    tuned rows replace only their own keys in a shape's existing entry, whose layout stays (a re-tune of some row
    counts, e.g. prefill sizes); without an entry the shape is decided as without merge. pool: (executor, processes)
    that compile each stage's launches in parallel first (precompile)."""
    from timing import copies, time_ms

    from vserve.kernels import triton_w4a16, triton_w4a16_tc, w4a16_dispatch

    sms = _sms(dev)
    name = w4a16_dispatch.device_name(torch.device(dev))
    table = json.loads(w4a16_dispatch.CONFIG_FILE.read_text())
    entries, log_rows = {}, []
    precompile(pool, dev, dtype, [(K, N, cfg) for K, N in shapes for M in rows for cfg in grid(M, N, K, sms)])
    for K, N in shapes:
        awq = copies(lambda K=K, N=N: checkpoint("awq", K, N, dev)[:3], K * N // 2, cold)
        tc = [tc_weight((*c, None, "awq"), K, N) for c in awq]
        rows_out, totals = {}, {"tc": 0.0, "today": 0.0}
        for M in rows:
            x = torch.randn(M, K, device=dev, dtype=dtype)
            o = torch.empty(M, N, device=dev, dtype=dtype)
            # prefill-sized M: compute-bound (one weight copy; a call takes milliseconds: fewer of them), best one only
            big = M > 256 and not timing
            tkw, tci, aci, best_n = (dict(iters=3, repeats=3, warmup=1), tc[:1], awq[:1], 1) if big else \
                (timing, tc, awq, 3)

            def run(qw, s, z, p, gs, cfg, _x=x, _o=o):
                triton_w4a16_tc.tc_gemm(_x, qw, s, z, p, gs, _o, **cfg)

            timed = []
            for cfg in grid(M, N, K, sms):
                try:
                    timed.append((time_ms(partial(run, cfg=cfg), dev, tci, **tkw), cfg))
                except Exception as e:  # out of shared memory or registers: keep the others
                    log(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
            timed.sort(key=lambda t: t[0])
            stage2 = [c2 for _, cfg in timed[:best_n]  # the best ones at other depths (deeper for small M), not wide
                      for c2 in [dict(cfg, num_stages=st) for st in ((2, 3, 4, 5, 6) if M <= 16 else (2, 3, 4))
                                 if st != cfg["num_stages"]]
                      + ([dict(cfg, wide=False)] if cfg.get("wide") else [])]
            stage2 = [c2 for i, c2 in enumerate(stage2)  # not again: a launch stage 1 or an earlier one here timed
                      if c2 not in [c for _, c in timed] and c2 not in stage2[:i]]
            precompile(pool, dev, dtype, [(K, N, c2) for c2 in stage2])
            for c2 in stage2:
                try:
                    timed.append((time_ms(partial(run, cfg=c2), dev, tci, **tkw), c2))
                except Exception as e:
                    log(f"  {c2}: {type(e).__name__}: {str(e)[:100]}")
            timed.sort(key=lambda t: t[0])
            best_ms, best = timed[0]
            deq_ms = time_ms(lambda qw, s, z, p, gs, _x=x: triton_w4a16.w4a16_gemm(_x, qw, s, z, p, "tc", 4, gs,
                                                                                   path="dequant"), dev, tci, **tkw)
            today_ms = time_ms(lambda qw, s, z, _x=x: triton_w4a16.w4a16_gemm(_x, qw, s, z, None, "awq", 4, GROUP,
                                                                              path="auto"), dev, aci, **tkw)
            path = "tc" if best_ms <= deq_ms else "dequant"
            rows_out[str(M)] = dict(path=path, **(best if path == "tc" else {}),
                                    _ms=dict(tc=round(best_ms, 5), dequant=round(deq_ms, 5), today=round(today_ms, 5)))
            totals["tc"] += min(best_ms, deq_ms)
            totals["today"] += today_ms
            if M == rows[0]:
                totals["batch1"] = (min(best_ms, deq_ms), today_ms)
            log_rows.append(dict(K=K, N=N, M=M, best=best, tc_ms=best_ms, dequant_ms=deq_ms, today_ms=today_ms,
                                 grid=[dict(ms=t, **c) for t, c in timed]))
            log(f"tune {NAMES.get((K, N), f'{K}x{N}'):8s} M={M:<4} tc {best_ms:.4f} ({best})  dequant {deq_ms:.4f}  "
                f"today {today_ms:.4f}  [{len(timed)} launches]")
        b1_tc, b1_today = totals.get("batch1", (0.0, 0.0))
        use_tc = totals["tc"] < totals["today"] and b1_tc <= b1_today * (1 + slack)
        old = table.get("devices", {}).get(name, {}).get("shapes", {}).get(f"N={N},K={K}")
        if merge and old is not None:
            key = "rows" if old.get("layout") == "tc" else "_tc_rows"
            entries[f"N={N},K={K}"] = dict(old, **{key: dict(sorted({**old.get(key, {}), **rows_out}.items(),
                                                                    key=lambda kv: int(kv[0])))})
            use_tc = old.get("layout") == "tc"
        else:
            entries[f"N={N},K={K}"] = dict(layout="tc", rows=rows_out) if use_tc else \
                dict(layout="checkpoint", rows={"1": {"path": "auto"}}, _tc_rows=rows_out)
        log(f"tune {NAMES.get((K, N), f'{K}x{N}')}: summed tc {totals['tc']:.4f} vs today {totals['today']:.4f} ms, "
            f"M={rows[0]} {b1_tc:.4f} vs {b1_today:.4f}: layout {'tc' if use_tc else 'checkpoint'}"
            + (" (kept: --merge)" if merge and old is not None else ""))
        del awq, tc
        table.setdefault("devices", {}).setdefault(name, {}).setdefault("shapes", {}).update(entries)
        if save is not None:
            save.write_text(json.dumps(table, indent=1) + "\n")
    return table, log_rows


# ---- report ------------------------------------------------------------------------------------------------------


def markdown(res: dict) -> str:
    gl = res.get("gemlite") or f"gemlite: {res.get('gemlite_missing')}"
    lines = [f"# W4A16 per GEMM ({res['device']}, {gl})", ""]
    if res.get("check"):
        bad = [r for r in res["check"] if r["ok"] is False]
        worst = max((r for r in res["check"] if r["ok"] is not None), key=lambda r: r["rel_err"] / r["limit"])
        judged = [r for r in res["check"] if r["ok"] is not None]
        lines += [f"check: {sum(r['ok'] for r in judged)}/{len(judged)} ok; worst {worst['path']} {worst['layout']} "
                  f"M={worst['M']} {worst['dtype']}: "
                  f"{worst['rel_err']:.2e} (limit {worst['limit']:.2e})", ""]
        lines += [f"- FAIL {r}" for r in bad] + ([""] if bad else [])
    if res.get("compare"):
        have = [p for p in ("tc", "today", "bf16", "gemlite") if any(f"{p}_ms" in r for r in res["compare"])]
        lines += ["| shape | M | " + " | ".join(f"{p} ms" for p in have) + " | tc TFLOP/s | tc GB/s | tc / bf16 | "
                  "tc / today | tc path |", "|" + " --- |" * (len(have) + 7)]
        for r in res["compare"]:
            lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(f"{r[p + '_ms']:.4f}" if p + "_ms" in r else "-"
                                                                     for p in have)
                         + f" | {r['tc_TFLOPs']:.1f} | {r['tc_GBps']:.0f} | {r['tc_vs_bf16']:.2f}x | "
                           f"{r['tc_vs_today']:.2f}x | {r['tc_path']} |")
        lines.append("")
    if res.get("tune"):
        lines += ["| shape | M | best tc launch | tc ms | dequant ms | today ms |", "|" + " --- |" * 6]
        for r in res["tune"]:
            lines.append(f"| {NAMES.get((r['K'], r['N']), r['K'])} | {r['M']} | {r['best']} | {r['tc_ms']:.4f} | "
                         f"{r['dequant_ms']:.4f} | {r['today_ms']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="bf16/fp16 on the GPU vs the dequantized-weight GEMM")
    ap.add_argument("--compare", action="store_true", help="ms, TFLOP/s, GB/s: tc, today, cuBLAS bf16, gemlite")
    ap.add_argument("--tune", action="store_true", help="launch grid per M bucket -> OUT/w4a16_configs.json")
    ap.add_argument("--wide-ab", action="store_true", help="the kernel with and without WIDE at the same launches")
    ap.add_argument("--words-ab", action="store_true",
                    help="the kernel with its 16-bit scales read as int32 words and as stored, at the same launches")
    ap.add_argument("--even-ab", action="store_true",
                    help="the kernel with and without its masks along N where the tile divides N, at the same launches")
    ap.add_argument("--profile", action="store_true",
                    help="each launch of profile_launches once, untimed: for Nsight Compute (run.sh w4ncu)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M for --compare and --tune")
    ap.add_argument("--compare-rows", default="", help="row counts for --compare when other than --rows")
    ap.add_argument("--shapes", default="", help="K:N,... instead of Llama-3-8B's four")
    ap.add_argument("--cold-mib", type=int, default=256, help="weight copies cycled per timed pass (0: one, hot)")
    ap.add_argument("--merge", action="store_true",
                    help="--tune: the tuned rows replace only their keys in the table's existing entries")
    ap.add_argument("--compile-workers", type=int, default=None,
                    help="--tune: processes that compile each stage's launches first (default: the CPUs, up to 16; "
                         "0: none)")
    ap.add_argument("--batch1-slack", type=float, default=0.0,
                    help="--tune: how much slower than today the tc layout may be at the first row count (0.02: 2%%)")
    from timing import parse_args

    args = parse_args(ap, argv, "tiny shapes on the CPU under TRITON_INTERPRET=1 (--check --compare --tune)")
    if args is None:
        return 2
    from timing import smoke_iters

    if args.cpu_smoke:
        args.check = args.compare = args.tune = args.wide_ab = args.words_ab = args.even_ab = args.profile = True
        dev, shapes, rows, check_rows, dtype, cold = "cpu", [(256, 64)], [1, 5], [1, 5], torch.float16, 0
        timing = smoke_iters(True)
    else:
        dev, dtype, cold = "cuda", torch.bfloat16, args.cold_mib << 20
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES
        rows, check_rows = [int(m) for m in args.rows.split(",")], CHECK_ROWS
        timing = {}
        if not (args.check or args.compare or args.tune or args.wide_ab or args.words_ab or args.even_ab
                or args.profile):
            ap.error("give --check, --compare, --tune, --wide-ab, --words-ab, --even-ab and/or --profile")
    from vserve.kernels import w4a16_dispatch

    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke: the numbers mean nothing)",
                 "torch": torch.__version__, "cold_bytes": cold, "table": str(w4a16_dispatch.CONFIG_FILE)}
    res["gemlite"] = None if args.cpu_smoke else _gemlite_setup()
    res["gemlite_missing"] = _gemlite.missing
    log(f"{res['device']}; {res['gemlite'] or 'gemlite not imported: ' + str(_gemlite.missing)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bad = []
    if args.check:
        res["check"] = check(dev, shapes, check_rows, args.cpu_smoke)
        bad = [r for r in res["check"] if r["ok"] is False]
        log(f"check: {sum(r['ok'] is True for r in res['check'])}/{sum(r['ok'] is not None for r in res['check'])} ok"
            + "".join(f"\n  FAIL {r}" for r in bad))
    for key, on in (("wide", args.wide_ab), ("scale_words", args.words_ab), ("even_n", args.even_ab)):
        if on:
            res[f"{key}_ab"] = launch_ab(dev, shapes, rows, dtype, cold, timing, key)
            bad += [c for r in res[f"{key}_ab"] for c in r["launches"] if c.get("ok") is False]
    if args.profile:
        res["profile"] = profile_launches(dev, shapes, rows, dtype, None if not args.cpu_smoke else [
            dict(block_n=64, block_m=16, split_k=1, num_warps=4, num_stages=2, scale_a=False, wide=True)])
    tuned = None
    if args.tune:  # before --compare, which then times the tuned launches
        workers = args.compile_workers if args.compile_workers is not None else 1 if args.cpu_smoke else \
            min(16, os.cpu_count() or 1)
        with contextlib.ExitStack() as stack:
            pool = (stack.enter_context(ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))),
                    workers) if workers > 0 else None
            table, res["tune"] = tune(dev, shapes, rows, dtype, cold, dict(iters=1, repeats=1, warmup=1) if
                                      args.cpu_smoke else timing, args.batch1_slack, out / "w4a16_configs.json",
                                      args.merge, pool)
        log(f"tuned table: {out / 'w4a16_configs.json'}")
        os.environ["VSERVE_W4A16_CONFIGS"] = str(out / "w4a16_configs.json")  # --compare's other rows: this table
        w4a16_dispatch.reload()
        tuned = {(r["K"], r["N"], r["M"]): ("tc", r["best"]) if r["tc_ms"] <= r["dequant_ms"] else ("dequant", {})
                 for r in res["tune"]}
    if args.compare:
        crows = [int(m) for m in args.compare_rows.split(",")] if args.compare_rows and not args.cpu_smoke else rows
        res["compare"] = compare(dev, shapes, crows, dtype, cold, timing, args.cpu_smoke, tuned)
    (out / "w4a16_tc.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "w4a16_tc.md").write_text(markdown(res))
    print(markdown(res))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
