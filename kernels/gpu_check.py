"""GPU check: the Triton kernels against their references in bf16/fp16 on real-model shapes, plus a microbenchmark.

    python -m vserve.kernels.gpu_check --out gpu_check.md [--sweep] [--skip-bench]

Correctness is measured against the reference run in float32 on the same (low-precision) inputs; the column
"torch err" is the reference's own error when run in the low dtype, for scale. The W8A8 activation quantizers must
be bit-exact: per_token_quant against its reference, each fused one against the kernels it replaces. The sampling
kernel must draw the reference's token on every row, or one the float64 CDF shows to be a tie at a CDF boundary
(its "max abs err" is the share of rows whose token differs from the reference's). The split-K FP8 GEMM must be
within 2% of the output's largest value of the fp32 sum (bf16 rounding plus sm_90's FP8 accumulation). Decode is
reported as GB/s of KV read against the H200's measured copy rate; prefill as TFLOP/s against torch's SDPA flash
backend and torch.nn.attention.varlen.varlen_attn when the installed torch has it; sampling as GB/s of logits read
once, against the torch path it replaced (softmax + cumsum + searchsorted). ``--tiny`` shrinks every shape so
the script itself can be smoke-tested on a CPU under TRITON_INTERPRET=1 (its timings then mean nothing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

PEAK_TBPS = 4.27  # device-to-device copy rate measured on this workplace's H200s (datasheet: 4.8)


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    window: int | None = None  # sliding-window attention (checked where set: decode and prefill take window=)
    softcap: float | None = None  # attention logit softcapping (Gemma 2)


MODELS = {
    "llama3-8b": ModelShape(32, 8, 128, 4096, 14336, 128256),
    "smollm2-135m": ModelShape(9, 3, 64, 576, 1536, 49152),
    # head_dim 256, a 1,024-token window (shorter than the check's contexts) and softcap 50: issue #25's kernels
    "gemma2-9b-window": ModelShape(16, 8, 256, 3584, 14336, 256000, window=1024, softcap=50.0),
}
TINY_MODELS = {"tiny-gqa4": ModelShape(4, 1, 64, 128, 192, 1000), "tiny-gqa3": ModelShape(3, 1, 64, 96, 160, 5003),
               "tiny-gemma2": ModelShape(4, 2, 256, 128, 192, 1000, window=24, softcap=50.0)}
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}  # atol, rtol against the fp32 reference


@dataclass
class CheckRow:
    kernel: str
    case: str
    dtype: str
    err: float  # max abs error against the float32 reference
    ok: bool
    tol: str = "-"
    torch_err: float | None = None  # the reference's own max abs error in the low dtype

    def cells(self) -> list[str]:
        torch_err = "-" if self.torch_err is None else f"{self.torch_err:.2e}"
        return [self.kernel, self.case, self.dtype, f"{self.err:.2e}", torch_err, self.tol,
                "PASS" if self.ok and not math.isnan(self.err) else "FAIL"]


CHECK_HEADER = ["kernel", "case", "dtype", "max abs err", "torch err", "tol", "result"]


@dataclass
class BenchRow:
    kernel: str
    case: str
    impl: str
    ms: float | None
    rate: float | None  # GB/s for decode, TFLOP/s for prefill
    unit: str
    note: str = ""

    def cells(self, base: float | None = None) -> list[str]:
        if self.ms is None:
            return [self.kernel, self.case, self.impl, "-", "-", "-", self.note]
        if self.unit == "GB/s":
            rel = f"{self.rate / (PEAK_TBPS * 1e3):.0%} of {PEAK_TBPS} TB/s"
        else:
            rel = f"{self.rate / base:.2f}x best torch" if base else "-"
        return [self.kernel, self.case, self.impl, f"{self.ms:.3f}", f"{self.rate:.1f} {self.unit}", rel, self.note]


BENCH_HEADER = ["kernel", "case", "impl", "ms", "rate", "relative", "note"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vserve.kernels.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the report as markdown to this path")
    p.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated, of bfloat16, float16")
    p.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    p.add_argument("--skip-bench", action="store_true", help="correctness only")
    p.add_argument("--sweep", action="store_true", help="also time a small grid of launch parameters")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, to smoke-test the script (e.g. on a CPU)")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- inputs


def _paged(ctx: list[int], bs: int, kvh: int, d: int, dtype: torch.dtype, dev: str):
    """Caches with each sequence's blocks scattered over the pool; block table padding points at real blocks."""
    nblocks = [-(-n // bs) for n in ctx]
    num_blocks = sum(nblocks) + 1
    k_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=dev)
    v_cache = torch.randn(num_blocks, bs, kvh, d, dtype=dtype, device=dev)
    bt = torch.randint(0, num_blocks, (len(ctx), max(nblocks)), dtype=torch.int32, device=dev)
    perm = torch.randperm(num_blocks, device=dev).int()
    used = 0
    for b, nb in enumerate(nblocks):
        bt[b, :nb] = perm[used:used + nb]
        used += nb
    return k_cache, v_cache, bt, torch.tensor(ctx, dtype=torch.int32, device=dev)


def _cu(qlens: list[int], dev: str) -> torch.Tensor:
    return torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(len(qlens))], dtype=torch.int32, device=dev)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _attn_row(kernel, case, dtype, out, ref32, ref_low) -> CheckRow:
    atol, rtol = TOL[dtype]
    ok = bool(torch.allclose(out.float(), ref32, atol=atol, rtol=rtol))
    return CheckRow(kernel, case, str(dtype).removeprefix("torch."), _err(out, ref32), ok,
                    f"{atol:.0e} + {rtol:.1e}·abs(ref)", _err(ref_low, ref32))


# ---------------------------------------------------------------------------------------------------- checks


def check_attention(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[CheckRow]:
    from vserve.kernels import paged_attention as ref
    from vserve.kernels import triton_attention as tri

    rows = []
    H, kvh, d = m.num_heads, m.num_kv_heads, m.head_dim
    scale = d**-0.5
    sw = {k: v for k, v in (("window", m.window), ("softcap", m.softcap)) if v is not None}
    B, max_ctx = (3, 90) if tiny else (64, 4096)
    for bs in (16, 64, 256):
        case = f"{name} bs={bs}"
        # store: a step's tokens into scattered slots, a quarter of them padding (-1)
        T = 40 if tiny else 4096
        k_cache = torch.randn(-(-T // bs) * 2, bs, kvh, d, dtype=dtype, device=dev)
        v_cache = torch.randn_like(k_cache)
        slots = torch.randperm(k_cache.shape[0] * bs, device=dev)[:T]
        slots[torch.rand(T, device=dev) < 0.25] = -1
        k, v = torch.randn(T, kvh, d, dtype=dtype, device=dev), torch.randn(T, kvh, d, dtype=dtype, device=dev)
        kc, vc = k_cache.clone(), v_cache.clone()
        tri.store_kvcache(k, v, kc, vc, slots)
        ref.store_kvcache_ref(k, v, k_cache, v_cache, slots)
        err = max(_err(kc, k_cache), _err(vc, v_cache))
        rows.append(CheckRow("store_kvcache", case + f" T={T}", str(dtype).removeprefix("torch."), err, err == 0,
                             "exact"))

        # decode: B sequences, random context lengths up to max_ctx (the extremes included)
        ctx = torch.randint(1, max_ctx + 1, (B,)).tolist()
        ctx[0], ctx[-1] = 1, max_ctx
        k_cache, v_cache, bt, ctx_lens = _paged(ctx, bs, kvh, d, dtype, dev)
        q = torch.randn(B, H, d, dtype=dtype, device=dev)
        out = tri.paged_decode_attention(q, k_cache, v_cache, bt, ctx_lens, scale, **sw)
        r32 = ref.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, ctx_lens, scale, **sw)
        rlow = ref.paged_decode_attention_ref(q, k_cache, v_cache, bt, ctx_lens, scale, **sw)
        rows.append(_attn_row("decode", case + f" B={B} ctx<={max_ctx}", dtype, out, r32, rlow))
        # 4 sequences: 256-token partitions, up to 16 a sequence, combined by the last one to finish or by the
        # reduce kernel
        for fused in (True, False):
            out = tri.paged_decode_attention(q[-4:], k_cache, v_cache, bt[-4:], ctx_lens[-4:], scale,
                                             fused_reduce=fused, **sw)
            rows.append(_attn_row("decode", case + f" B={min(4, B)} ctx<={max_ctx} " +
                                  ("fused reduce" if fused else "reduce kernel"),
                                  dtype, out, r32[-4:], rlow[-4:]))
        del k_cache, v_cache, r32, rlow

        # prefill: whole prompts and chunks after a cached prefix, mixed lengths
        seqs = ([(90, 90), (80, 7), (1, 1), (50, 33)] if tiny else
                [(4096, 4096), (4096, 512), (1024, 1024), (3000, 1), (777, 300), (2048, 2048), (129, 129)])
        k_cache, v_cache, bt, ctx_lens = _paged([c for c, _ in seqs], bs, kvh, d, dtype, dev)
        cu = _cu([n for _, n in seqs], dev)
        q = torch.randn(int(cu[-1]), H, d, dtype=dtype, device=dev)
        out = tri.paged_prefill_attention(q, k_cache, v_cache, cu, ctx_lens, bt, scale, **sw)
        r32 = ref.paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), cu, ctx_lens, bt, scale,
                                              **sw)
        rlow = ref.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx_lens, bt, scale, **sw)
        rows.append(_attn_row("prefill", case + f" {len(seqs)} seqs T={int(cu[-1])}", dtype, out, r32, rlow))
        if bs == 16 and not sw:
            rows += _check_fp8_cache(case, k, v, slots, q, cu, ctx_lens, bt, ctx, B, H, kvh, d, scale, dtype, dev)
    return rows


def _check_fp8_cache(case, k, v, slots, q_prefill, cu, ctx_prefill, bt_prefill, ctx, B, H, kvh, d, scale, dtype,
                     dev) -> list[CheckRow]:
    """--kv-cache-dtype fp8: the store rounds as the reference (bit for bit); decode and prefill over an fp8
    cache against the fp32 reference on the same fp8 values."""
    from vserve.kernels import paged_attention as ref
    from vserve.kernels import triton_attention as tri

    f8, name = torch.float8_e4m3fn, str(dtype).removeprefix("torch.") + ", fp8 KV"
    bs = 16
    kc = torch.zeros(-(-k.shape[0] // bs) * 2, bs, kvh, d, dtype=f8, device=dev)
    vc, k_ref, v_ref = kc.clone(), kc.clone(), kc.clone()
    tri.store_kvcache(k * 50, v, kc, vc, slots)  # * 50: values beyond 448 saturate
    ref.store_kvcache_ref(k * 50, v, k_ref, v_ref, slots)
    exact = torch.equal(kc.view(torch.uint8), k_ref.view(torch.uint8)) and \
        torch.equal(vc.view(torch.uint8), v_ref.view(torch.uint8))
    rows = [CheckRow("store_kvcache", case + f" T={k.shape[0]}", name, 0.0 if exact else float("nan"), exact,
                     "exact bytes")]
    k_cache, v_cache, bt, ctx_lens = _paged(ctx, bs, kvh, d, dtype, dev)
    k8, v8 = k_cache.to(f8), v_cache.to(f8)
    q = torch.randn(B, H, d, dtype=dtype, device=dev)
    out = tri.paged_decode_attention(q, k8, v8, bt, ctx_lens, scale)
    r32 = ref.paged_decode_attention_ref(q.float(), k8, v8, bt, ctx_lens, scale)
    rlow = ref.paged_decode_attention_ref(q, k8, v8, bt, ctx_lens, scale)
    rows.append(_attn_row("decode", case + f" B={B}, fp8 KV", dtype, out, r32, rlow))
    k_cache, v_cache = (torch.randn(bt_prefill.max().item() + 1, bs, kvh, d, dtype=dtype, device=dev)
                        for _ in range(2))
    k8, v8 = k_cache.to(f8), v_cache.to(f8)
    out = tri.paged_prefill_attention(q_prefill, k8, v8, cu, ctx_prefill, bt_prefill, scale)
    r32 = ref.paged_prefill_attention_ref(q_prefill.float(), k8, v8, cu, ctx_prefill, bt_prefill, scale)
    rlow = ref.paged_prefill_attention_ref(q_prefill, k8, v8, cu, ctx_prefill, bt_prefill, scale)
    rows.append(_attn_row("prefill", case + f" T={int(cu[-1])}, fp8 KV", dtype, out, r32, rlow))
    return rows


def check_ops(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[CheckRow]:
    from vserve.kernels import ops_ref
    from vserve.kernels import triton_ops as tri

    T = 33 if tiny else 4096
    dt = str(dtype).removeprefix("torch.")
    atol, rtol = TOL[dtype]
    tol = f"{atol:.0e} + {rtol:.1e}·abs(ref)"

    def row(kernel, out, expected, low=None):
        ok = bool(torch.allclose(out.float(), expected.float(), atol=atol, rtol=rtol))
        return CheckRow(kernel, f"{name} T={T}", dt, _err(out, expected), ok, tol,
                        None if low is None else _err(low, expected))

    x = torch.randn(T, m.hidden, dtype=dtype, device=dev)
    res = torch.randn(T, m.hidden, dtype=dtype, device=dev)
    w = (1 + 0.1 * torch.randn(m.hidden, device=dev)).to(dtype)
    normed, new_res = tri.fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = ops_ref.fused_add_rms_norm_ref(x, res, w, 1e-5)
    rows = [row("rms_norm", tri.rms_norm(x, w, 1e-5), ops_ref.rms_norm_ref(x, w, 1e-5)),
            row("fused_add_rms_norm", torch.cat([normed, new_res]), torch.cat([ref_normed, ref_res]))]
    g = torch.randn(T, 2 * m.intermediate, dtype=dtype, device=dev)
    rows.append(row("silu_and_mul", tri.silu_and_mul(g), ops_ref.silu_and_mul_ref(g)))
    rows += check_quant(f"{name} T={T}", dt, x, res, w, g)
    half = m.head_dim // 2
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, half, device=dev).float() / half))
    freqs = torch.outer(torch.arange(8192, device=dev).float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(T, m.num_heads + 2 * m.num_kv_heads, m.head_dim, dtype=dtype, device=dev)
    q, k = qkv[:, :m.num_heads], qkv[:, m.num_heads:m.num_heads + m.num_kv_heads]
    pos = torch.randint(0, 8192, (T,), device=dev)
    qo, ko = tri.rotary_embedding(pos, q, k, cos, sin)
    qr, kr = ops_ref.rotary_embedding_ref(pos, q, k, cos, sin)
    rows.append(row("rotary_embedding", torch.cat([qo.flatten(1), ko.flatten(1)], 1),
                    torch.cat([qr.flatten(1), kr.flatten(1)], 1)))
    rows.append(check_rope_store(name, m, dt, pos, qkv, cos, sin))
    return rows


def check_rope_store(name: str, m: ModelShape, dt: str, pos: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> CheckRow:
    """rope_store_kvcache (RoPE in the KV store's launch) against rotary_embedding then store_kvcache: the same
    rotated q and the same cache bytes (a quarter of the slots padding)."""
    from vserve.kernels import triton_attention, triton_ops

    H, kvh, d, T = m.num_heads, m.num_kv_heads, m.head_dim, qkv.shape[0]
    q, k, v = qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]
    bs = 16
    slots = torch.randperm(-(-T // bs) * 2 * bs, device=qkv.device)[:T]
    slots[torch.rand(T, device=qkv.device) < 0.25] = -1
    caches = [torch.randn(-(-T // bs) * 2, bs, kvh, d, dtype=qkv.dtype, device=qkv.device) for _ in range(2)]
    kc, vc, kc2, vc2 = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    qo = triton_attention.rope_store_kvcache(pos, q, k, v, cos, sin, kc, vc, slots)
    q2, k2 = triton_ops.rotary_embedding(pos, q, k, cos, sin)
    triton_attention.store_kvcache(k2, v, kc2, vc2, slots)
    err = max(_err(qo, q2), _err(kc, kc2), _err(vc, vc2))
    return CheckRow("rope_store_kvcache", f"{name} T={T}", dt, err, err == 0, "exact (vs the two kernels)")


def check_quant(case: str, dt: str, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor,
                g: torch.Tensor) -> list[CheckRow]:
    """W8A8 activation quantizers, exact: per_token_quant against its reference, and each fused one (the norm or
    SiLU-and-mul quantizing its output) against the two kernels it replaces: the same codes, scales and residual
    bit for bit, so serving gives the same tokens with and without the fusion."""
    import triton

    from vserve.kernels import ops_ref
    from vserve.kernels import triton_ops as tri

    def exact(kernel, got, expected, same_residual=True):
        (q, s), (rq, rs) = got, expected
        same = same_residual and torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        return CheckRow(kernel, case, dt, _err(q.float() * s, rq.float() * rs), same, "bit-exact")

    rows, chunk = [], triton.next_power_of_2(g.shape[-1] // 2) // 4  # a row of g's SiLU output in 4 chunks
    normed, new_res = tri.fused_add_rms_norm(x, res, w, 1e-5)
    for qdt, q in ((torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")):
        fused, fused_res = tri.fused_add_rms_norm_quant(x, res, w, 1e-5, qdt)
        rows += [exact(f"per_token_quant {q}", tri.per_token_quant(x, qdt), ops_ref.per_token_quant_ref(x, qdt)),
                 exact(f"rms_norm_quant {q}", tri.rms_norm_quant(x, w, 1e-5, qdt),
                       tri.per_token_quant(tri.rms_norm(x, w, 1e-5), qdt)),
                 exact(f"fused_add_rms_norm_quant {q}", fused, tri.per_token_quant(normed, qdt),
                       torch.equal(fused_res, new_res)),
                 exact(f"silu_and_mul_quant {q}", tri.silu_and_mul_quant(g, qdt),
                       tri.per_token_quant(tri.silu_and_mul(g), qdt)),
                 exact(f"silu_and_mul_quant {q} (2 passes)", tri.silu_and_mul_quant(g, qdt, block=chunk),
                       tri.per_token_quant(tri.silu_and_mul(g), qdt))]
    return rows


SAMPLING_TIE_RTOL = 1e-5  # fp32 prefix sums over 128k columns drift ~1e-6 of the total; a wrong token is off by more


def _sampling_inputs(B: int, V: int, dtype: torch.dtype, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits as the sampler sees them: flat to peaked rows, a quarter of them top-k 50 (the rest -inf); from 4
    rows on, a one-hot row and u at both extremes."""
    logits = torch.randn(B, V, device=dev) * torch.linspace(0.5, 6.0, B, device=dev).unsqueeze(1)
    kth = logits.topk(min(50, V), dim=-1).values[:, -1:]
    topk = torch.arange(B, device=dev).unsqueeze(1) % 4 == 1
    logits = logits.masked_fill(topk & (logits < kth), float("-inf"))
    u = torch.rand(B, device=dev)
    if B >= 4:
        logits[-1] = float("-inf")
        logits[-1, V // 3] = 0.0
        u[0], u[2] = 0.0, 1.0 - 2.0**-24
    return logits.to(dtype), u


def _graph_replay(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fn's output from a CUDA graph of one call, replayed once (fn has run eagerly: its kernels are compiled)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    return out


def _sampling_path(B: int, V: int, cfg: dict, dev: str) -> str:
    """Which of sample_from_logits' paths cfg takes at [B, V]: split rows (chunks P, columns C) or not."""
    from vserve.kernels import triton_sampling as tri

    P, C = tri.split_plan(B, V, cfg.get("splits"), cfg.get("split_block", 1024), torch.device(dev))
    return f"split P={P} C={C}" if P > 1 else "one program per row"


def check_sampling(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[CheckRow]:
    """sample_from_logits against its reference on the same logits (in dtype, and in float32 as the engine
    samples), on both paths: split rows at batch 1 and 4 (the default there; forced on the tiny shapes), and at 256
    rows the default (one program per row: more rows than SMs) and split in 2. The err column
    is the share of rows whose token differs, all of them CDF-boundary ties and none a masked token; on CUDA a CUDA
    graph of the call must replay the eager tokens. The torch err column is the share of rows where the reference
    itself differs from a float64 draw."""
    from vserve.kernels import sampling_ref
    from vserve.kernels import triton_sampling as tri

    cases = ([(1, dict(splits=2, split_block=128)), (5, dict(splits=3, split_block=128)), (5, dict(splits=1))]
             if tiny else [(1, {}), (4, {}), (256, {}), (256, dict(splits=2))])
    graph = dev.startswith("cuda")
    rows = []
    for B, cfg in cases:
        case = f"{name} B={B} V={m.vocab} {_sampling_path(B, m.vocab, cfg, dev)}"
        for dt in dict.fromkeys((dtype, torch.float32)):
            logits, u = _sampling_inputs(B, m.vocab, dt, dev)
            draw = partial(tri.sample_from_logits, logits, u, **cfg)
            got, ref = draw(), sampling_ref.sample_from_logits_ref(logits, u)
            exact = sampling_ref.sample_from_logits_ref(logits.double(), u.double())
            ties = sampling_ref.cdf_boundary_ties(logits, u, got, ref, SAMPLING_TIE_RTOL)
            ok = bool(ties.all()) and bool(logits.gather(1, got.unsqueeze(1)).isfinite().all())
            ok = ok and (not graph or torch.equal(_graph_replay(draw), got))
            rows.append(CheckRow("sample_from_logits", case, str(dt).removeprefix("torch."),
                                 float((got != ref).float().mean()), ok,
                                 f"ties <= {SAMPLING_TIE_RTOL:.0e}·sum" + (", graph = eager" if graph else ""),
                                 float((ref != exact).float().mean())))
    return rows


def check_fp8_mm(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[CheckRow]:
    """The split-K FP8 GEMM (triton_fp8_mm) against fp8_mm_ref on the model's four linear shapes, with each launch
    scaled_mm.FP8_SPLITK holds for the shape (one- and two-split launches, swapped or not, for shapes it does not
    list), at a few row counts. Tolerance 2% of the output's largest value: the bf16/fp16 rounding plus sm_90's FP8
    accumulation, which is not a full fp32 sum (1.0% measured at K = 14336, as cuBLAS's fast accumulation)."""
    from vserve.kernels import ops_ref, scaled_mm, triton_fp8_mm

    shapes = {"qkv": (m.hidden, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim),
              "o": (m.num_heads * m.head_dim, m.hidden), "gate_up": (m.hidden, 2 * m.intermediate),
              "down": (m.intermediate, m.hidden)}
    rows = []
    for proj, (K, N) in shapes.items():
        if tiny:
            launches = [dict(block_m=16, block_n=32, block_k=32, split_k=sk, num_warps=4, num_stages=1, swap=sw)
                        for sk in (1, 2) if K % (32 * sk) == 0 for sw in (False, True)]
        else:
            listed = [cfg for _, cfg in scaled_mm.FP8_SPLITK.get((K, N), ()) if cfg is not None]
            launches = listed or [dict(block_m=bm, block_n=64, block_k=128, split_k=sk, num_warps=4, num_stages=st,
                                       swap=bm < 64) for sk in (1, 2) if K % (128 * sk) == 0
                                  for bm, st in ((64, 5), (16, 6))]
        wq, ws = ops_ref.per_token_quant_ref(torch.randn(N, K, device=dev) * 0.05, torch.float8_e4m3fn)
        for M in ((1, 5, 33) if tiny else (1, 16, 100, 256)):
            xq, xs = ops_ref.per_token_quant_ref(torch.randn(M, K, device=dev), torch.float8_e4m3fn)
            ref = scaled_mm.fp8_mm_ref(xq, xs, wq, ws, torch.float32)
            scale = float(ref.abs().max())
            for cfg in launches:
                got = triton_fp8_mm.fp8_mm_splitk(xq, xs, wq, ws, dtype, **cfg)
                err = float((got.float() - ref).abs().max())
                label = (f"{name} {proj} {K}x{N} M={M} bm={cfg['block_m']} bn={cfg['block_n']} "
                         f"bk={cfg['block_k']} split={cfg['split_k']}" + (" swap" if cfg.get("swap") else ""))
                rows.append(CheckRow("fp8_mm_splitk", label, str(dtype).removeprefix("torch."), err,
                                     err <= 2e-2 * scale, "2e-2·max|ref|"))
    return rows


def check_lora(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[CheckRow]:
    """LoRA shrink + expand (triton_lora) against the float32 reference on the same low-dtype inputs, on the
    model's four adapted projections (qkv and gate_up packed: their slices in one launch): 8 slots, ranks 16 and 64,
    a decode-sized and a prefill-sized batch with rows spread unevenly over the slots and a quarter without adapter
    (those must stay bit-identical)."""
    from vserve.kernels import lora_ref, triton_lora

    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projs = {"qkv": (m.hidden, (q, kv, kv)), "o": (q, (m.hidden,)), "gate_up": (m.hidden, (m.intermediate,) * 2),
             "down": (m.intermediate, (m.hidden,))}
    S, atol_rtol, rows = 8, TOL.get(dtype, (1e-4, 1e-4)), []
    for R in (16, 64):
        for T in ((5, 37) if tiny else (64, 2048)):
            slots = torch.randint(0, S, (T,), device=dev) ** 2 // S  # uneven: low slots get more rows
            slots[torch.rand(T, device=dev) < 0.25] = -1
            m_ = lora_ref.lora_mapping(slots, S)
            for proj, (K, widths) in projs.items():
                bounds = tuple(sum(widths[:j]) for j in range(len(widths) + 1))
                x = torch.randn(T, K, device=dev, dtype=dtype)
                a = (torch.randn(S, len(widths) * R, K, device=dev) / K**0.5).to(dtype)
                b = (torch.randn(S, bounds[-1], R, device=dev) * 0.1).to(dtype)
                base = torch.randn(T, bounds[-1], device=dev, dtype=dtype)
                out = base.clone()
                triton_lora.lora_expand(triton_lora.lora_shrink(x, a, m_), b, out, m_, bounds)
                ref = base.float()
                lora_ref.lora_expand_ref(lora_ref.lora_shrink_ref(x.float(), a.float(), m_), b.float(), ref, m_,
                                         bounds)
                low = base.clone()
                lora_ref.lora_expand_ref(lora_ref.lora_shrink_ref(x, a, m_), b, low, m_, bounds)
                keep = slots < 0
                ok = torch.allclose(out.float(), ref, *atol_rtol[::-1]) and torch.equal(out[keep], base[keep])
                rows.append(CheckRow("lora_shrink+expand", f"{name} {proj} T={T} R={R} slots={S}",
                                     str(dtype).removeprefix("torch."), _err(out, ref), ok,
                                     f"{atol_rtol[0]:.0e}+{atol_rtol[1]:.0e}·|ref|", _err(low, ref)))
    return rows


# ---------------------------------------------------------------------------------------------------- timing


def time_ms(fn: Callable[[], object], dev: str, graph: bool = True, iters: int = 20) -> tuple[float, bool]:
    """(ms per call, whether it ran as a CUDA graph): CUDA events around replays of a graph of `iters` calls (how
    the engine runs decode steps, free of Python launch overhead), or around `iters` eager calls when graph is
    False or capture fails."""
    if not dev.startswith("cuda"):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3, False
    for _ in range(3):  # compile and warm up
        fn()
    torch.cuda.synchronize()

    def eager() -> None:
        for _ in range(iters):
            fn()

    run, graphed = eager, False
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                eager()
            run, graphed = g.replay, True
        except Exception:  # not capturable: time it eagerly
            torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * iters), graphed


def _varlen_attn():
    """torch's varlen_attn and the keyword arguments this torch's version takes, or (None, set())."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    import inspect

    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _timed(rows: list[BenchRow], kernel: str, case: str, impl: str, fn: Callable[[], object], work: float,
           unit: str, dev: str, graph: bool = True) -> None:
    """Time fn and append a row; work is bytes (GB/s) or FLOPs (TFLOP/s). A failure becomes a row's note."""
    try:
        ms, graphed = time_ms(fn, dev, graph)
        rows.append(BenchRow(kernel, case, impl, ms, work / ms / (1e6 if unit == "GB/s" else 1e9), unit,
                             "cuda graph" if graphed else "eager"))
    except Exception as e:  # a launch config that does not fit, or a baseline the installed torch lacks
        rows.append(BenchRow(kernel, case, impl, None, None, unit, _short(e)))


def bench_decode(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool, sweep: bool) -> list[BenchRow]:
    from vserve.kernels import triton_attention as tri

    rows: list[BenchRow] = []
    H, kvh, d = m.num_heads, m.num_kv_heads, m.head_dim
    ctx_len = 96 if tiny else 4096
    varlen, varlen_args = _varlen_attn()
    for B in (2,) if tiny else (8, 64):
        for bs in (16, 64, 256):
            k_cache, v_cache, bt, ctx_lens = _paged([ctx_len] * B, bs, kvh, d, dtype, dev)
            q = torch.randn(B, H, d, dtype=dtype, device=dev)
            nbytes = 2 * B * ctx_len * kvh * d * k_cache.element_size()
            case = f"{name} B={B} ctx={ctx_len} bs={bs}"
            configs = [{}]
            if sweep and bs == 16:
                configs += [dict(partition_size=p, block_n=n, num_warps=w) for p in (256, 512, 1024)
                            for n in (32, 64, 128) for w in (4, 8)]
            for cfg in configs:
                fn = partial(tri.paged_decode_attention, q, k_cache, v_cache, bt, ctx_lens, d**-0.5,
                             out=torch.empty_like(q), **cfg)
                _timed(rows, "decode", case, f"triton {cfg or '(default)'}", fn, nbytes, "GB/s", dev)
                if not cfg:  # the same call launched from Python: the launch overhead a graph removes
                    _timed(rows, "decode", case, "triton (default)", fn, nbytes, "GB/s", dev, graph=False)
            if bs == 16 and not tiny:  # --kv-cache-dtype fp8: half the bytes to read
                k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
                grid = [{}]
                if sweep:
                    grid += [dict(partition_size=p, block_n=n, num_warps=w) for p in (512, 1024, 2048)
                             for n in (64, 128) for w in (4, 8)]
                for cfg in grid:
                    fn = partial(tri.paged_decode_attention, q, k8, v8, bt, ctx_lens, d**-0.5,
                                 out=torch.empty_like(q), **cfg)
                    _timed(rows, "decode", case + " fp8 KV", f"triton {cfg or '(default)'}", fn,
                           nbytes // k_cache.element_size(), "GB/s", dev)
                del k8, v8
            if {"block_table", "seqused_k", "enable_gqa"} <= varlen_args:
                cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
                fn = partial(varlen, q, k_cache, v_cache, cu_q, cu_q * ctx_len, 1, ctx_len, scale=d**-0.5,
                             enable_gqa=kvh != H, seqused_k=ctx_lens, block_table=bt)
                _timed(rows, "decode", case, "varlen_attn paged", fn, nbytes, "GB/s", dev)
            elif varlen is not None:
                rows.append(BenchRow("decode", case, "varlen_attn paged", None, None, "GB/s",
                                     "this torch's varlen_attn takes no block_table"))
    return rows


def bench_lora(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[BenchRow]:
    """LoRA shrink + expand (rank 16, 8 slots and at 256 rows also 32, rows round-robin over the slots) against the
    projection's own GEMM (F.linear) at decode and prefill row counts: the LoRA path's cost per projection (issue #28
    wants a step with 8 adapters at >= 0.8x the base model's throughput). TFLOP/s of each one's own multiply-adds."""
    from torch.nn import functional as F

    from vserve.kernels import lora_ref, triton_lora

    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projs = {"qkv": (m.hidden, (q, kv, kv)), "o": (q, (m.hidden,)), "gate_up": (m.hidden, (m.intermediate,) * 2),
             "down": (m.intermediate, (m.hidden,))}
    R, rows = 16, []
    for S, T in ([(8, 3)] if tiny else [(8, 1), (8, 64), (8, 256), (32, 256), (8, 2048)]):
        slots = torch.arange(T, device=dev) % S
        mapping = lora_ref.lora_mapping(slots, S)
        for proj, (K, widths) in projs.items():
            N = sum(widths)
            bounds = tuple(sum(widths[:j]) for j in range(len(widths) + 1))
            x = torch.randn(T, K, device=dev, dtype=dtype)
            w = torch.randn(N, K, device=dev, dtype=dtype) * 0.02
            a = torch.randn(S, len(widths) * R, K, device=dev, dtype=dtype) * 0.02
            b = torch.randn(S, N, R, device=dev, dtype=dtype) * 0.02
            out = torch.zeros(T, N, device=dev, dtype=dtype)
            case = f"{name} {proj} {K}x{N} T={T}"
            if S == 8:
                _timed(rows, "lora", case, "base GEMM (F.linear)", partial(F.linear, x, w), 2 * T * K * N,
                       "TFLOP/s", dev)

            def lora(x=x, a=a, b=b, out=out, bounds=bounds, mapping=mapping):
                triton_lora.lora_expand(triton_lora.lora_shrink(x, a, mapping), b, out, mapping, bounds)

            _timed(rows, "lora", case, f"shrink+expand R={R} slots={S}", lora,
                   2 * T * (K * len(widths) * R + N * R), "TFLOP/s", dev)
    return rows


def _torch_sample(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's draw before sample_from_logits (softmax + cumsum + searchsorted), the torch baseline."""
    cdf = logits.softmax(-1).cumsum(-1)
    return torch.searchsorted(cdf, ((1.0 - u) * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp_(max=logits.shape[1] - 1)


def bench_sampling(name: str, m: ModelShape, dev: str, tiny: bool, sweep: bool) -> list[BenchRow]:
    """sample_from_logits against the torch path on float32 logits (the engine's), GB/s of logits read once: split
    rows against one program per row at each batch size ("(default)" marks sample_from_logits' own choice), the
    split path over whole CUDA graphs as the engine runs it (the note says eager if capture failed)."""
    from vserve.kernels import sampling_ref
    from vserve.kernels import triton_sampling as tri

    rows: list[BenchRow] = []
    for B in (2,) if tiny else (1, 4, 16, 64, 256):
        logits, u = _sampling_inputs(B, m.vocab, torch.float32, dev)
        case, nbytes = f"{name} B={B} V={m.vocab}", logits.numel() * logits.element_size()
        auto = tri.split_plan(B, m.vocab, None, 1024, logits.device)[0]
        configs = [dict(splits=1), dict(splits=2, split_block=128) if tiny else dict(splits=max(auto, 2))]
        if sweep:
            configs += [dict(splits=1, block=b, num_warps=w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]
            configs += [dict(splits=s, split_block=b, split_warps=w) for b in (512, 1024, 2048) for w in (4, 8)
                        for s in sorted({max(auto // 2, 2), auto, 2 * auto})]
        for cfg in configs:
            fn = partial(tri.sample_from_logits, logits, u, **cfg)
            default = " (default)" if cfg == {"splits": auto} else ""
            _timed(rows, "sampling", case, f"triton {_sampling_path(B, m.vocab, cfg, dev)} {cfg}{default}", fn, nbytes,
                   "GB/s", dev)
        _timed(rows, "sampling", case, "torch softmax+cumsum+searchsorted", partial(_torch_sample, logits, u), nbytes,
               "GB/s", dev)
        _timed(rows, "sampling", case, "torch reference (+ zero-mass rule)",
               partial(sampling_ref.sample_from_logits_ref, logits, u), nbytes, "GB/s", dev)
    return rows


def bench_rope_store(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool) -> list[BenchRow]:
    """rope_store_kvcache (one launch a layer) against rotary_embedding then store_kvcache (two), CUDA-graphed as a
    decode step runs them; GB/s of q, k and v read and q, k and v written once."""
    from vserve.kernels import triton_attention

    rows: list[BenchRow] = []
    H, kvh, d, bs = m.num_heads, m.num_kv_heads, m.head_dim, 16
    half = d // 2
    freqs = torch.outer(torch.arange(8192, device=dev).float(), 1.0 / (500000.0 ** (torch.arange(half, device=dev)
                                                                                    / half)))
    cos, sin = freqs.cos(), freqs.sin()
    for T in (4,) if tiny else (1, 8, 64, 256):
        qkv = torch.randn(T, H + 2 * kvh, d, dtype=dtype, device=dev)
        q, k, v = qkv[:, :H], qkv[:, H:H + kvh], qkv[:, H + kvh:]
        pos = torch.randint(0, 8192, (T,), device=dev)
        kc = torch.zeros(-(-T // bs) * 4, bs, kvh, d, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(kc.shape[0] * bs, device=dev)[:T]
        nbytes = 2 * qkv.numel() * qkv.element_size()
        args = (pos, q, k, v, cos, sin, kc, vc, slots)
        case = f"{name} T={T}"
        _timed(rows, "rope + kv store", case, "rope_store_kvcache (one launch)",
               partial(triton_attention.rope_store_kvcache, *args), nbytes, "GB/s", dev)
        _timed(rows, "rope + kv store", case, "rotary_embedding, store_kvcache (two)",
               partial(_rope_then_store, *args), nbytes, "GB/s", dev)
    return rows


def _rope_then_store(pos, q, k, v, cos, sin, kc, vc, slots) -> torch.Tensor:
    from vserve.kernels import triton_attention, triton_ops

    qo, ko = triton_ops.rotary_embedding(pos, q, k, cos, sin)
    triton_attention.store_kvcache(ko, v, kc, vc, slots)
    return qo


def _sdpa_flash(q, k, v, scale, enable_gqa):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)


def bench_prefill(name: str, m: ModelShape, dtype: torch.dtype, dev: str, tiny: bool,
                  sweep: bool) -> list[tuple[BenchRow, float | None]]:
    """Rows paired with the best torch baseline's TFLOP/s on the same case."""
    from vserve.kernels import triton_attention as tri

    out_rows = []
    H, kvh, d = m.num_heads, m.num_kv_heads, m.head_dim
    scale, gqa = d**-0.5, kvh != H
    varlen, varlen_args = _varlen_attn()
    shapes = ({"2x64 causal": [(64, 64)] * 2, "2x16 after 48 cached": [(64, 16)] * 2} if tiny else
              {"8x1024 causal": [(1024, 1024)] * 8, "2x4096 causal": [(4096, 4096)] * 2,
               "8x512 after 3584 cached": [(4096, 512)] * 8})
    for label, seqs in shapes.items():
        rows: list[BenchRow] = []
        ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
        flops = 4 * d * H * sum(sum(range(c - n + 1, c + 1)) for c, n in seqs)
        case = f"{name} {label}"
        cu_q, cu_k = _cu(qlens, dev), _cu(ctx, dev)
        q = torch.randn(sum(qlens), H, d, dtype=dtype, device=dev)
        k = torch.randn(sum(ctx), kvh, d, dtype=dtype, device=dev)  # contiguous packed, for the torch baselines
        v = torch.randn_like(k)
        for bs in (16, 256):
            k_cache, v_cache, bt, ctx_lens = _paged(ctx, bs, kvh, d, dtype, dev)
            configs = [{}]
            if sweep and bs == 16 and label.startswith("2x4096"):
                configs += [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st) for bm in (32, 64, 128)
                            for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
            for cfg in configs:
                fn = partial(tri.paged_prefill_attention, q, k_cache, v_cache, cu_q, ctx_lens, bt, scale,
                             out=torch.empty_like(q), **cfg)
                _timed(rows, "prefill", case, f"triton bs={bs} {cfg or '(default)'}", fn, flops, "TFLOP/s", dev)
            if {"block_table", "seqused_k", "enable_gqa"} <= varlen_args and bs == 256:
                fn = partial(varlen, q, k_cache, v_cache, cu_q, cu_k, max(qlens), max(ctx), scale=scale,
                             window_size=(-1, 0), enable_gqa=gqa, seqused_k=ctx_lens, block_table=bt)
                _timed(rows, "prefill", case, "varlen_attn paged bs=256", fn, flops, "TFLOP/s", dev)
        if varlen is not None:
            if "enable_gqa" in varlen_args:
                fn = partial(varlen, q, k, v, cu_q, cu_k, max(qlens), max(ctx), scale=scale, window_size=(-1, 0),
                             enable_gqa=gqa)
                impl = "varlen_attn"
            else:  # an older varlen_attn: no GQA, so the kv heads are repeated (outside the timing)
                kr, vr = k.repeat_interleave(H // kvh, 1), v.repeat_interleave(H // kvh, 1)
                kw = {"window_size": (-1, 0)} if "window_size" in varlen_args else {"is_causal": True}
                fn = partial(varlen, q, kr, vr, cu_q, cu_k, max(qlens), max(ctx), scale=scale, **kw)
                impl = "varlen_attn (kv repeated)"
            _timed(rows, "prefill", case, impl, fn, flops, "TFLOP/s", dev)
        if len(set(seqs)) == 1 and seqs[0][0] == seqs[0][1]:  # equal whole prompts: a dense causal batch
            B, L = len(seqs), seqs[0][0]
            qd = q.view(B, L, H, d).transpose(1, 2)
            kd, vd = k.view(B, L, kvh, d).transpose(1, 2), v.view(B, L, kvh, d).transpose(1, 2)
            _timed(rows, "prefill", case, "sdpa flash", partial(_sdpa_flash, qd, kd, vd, scale, gqa), flops,
                   "TFLOP/s", dev)
            ke, ve = kd.repeat_interleave(H // kvh, 1), vd.repeat_interleave(H // kvh, 1)
            _timed(rows, "prefill", case, "sdpa flash (kv repeated)", partial(_sdpa_flash, qd, ke, ve, scale, False),
                   flops, "TFLOP/s", dev)
        base = max((r.rate for r in rows if r.rate and not r.impl.startswith("triton")), default=None)
        out_rows += [(r, base) for r in rows]
    return out_rows


# ---------------------------------------------------------------------------------------------------- main


def _env(dev: str) -> str:
    import triton

    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu (interpreter)"
    return f"device: {name}; torch {torch.__version__}; triton {triton.__version__}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); use --tiny --device cpu with "
              "TRITON_INTERPRET=1 to smoke-test it", file=sys.stderr)
        return 2
    table = TINY_MODELS if args.tiny else MODELS
    names = args.models.split(",") if args.models else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown model {unknown[0]!r} (known: {', '.join(table)})", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, s) for s in args.dtypes.split(",")]
    dev = args.device
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    report = [f"# vserve kernel check\n\n{_env(dev)}; torch.manual_seed({seed})\n"]

    def flush(section: str) -> None:
        report.append(section)
        print(section, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(report) + "\n")

    checks: list[CheckRow] = []
    for name in names:
        for dtype in dtypes:
            for fn in (check_attention, check_ops, check_sampling, check_fp8_mm, check_lora):
                try:
                    checks += fn(name, table[name], dtype, dev, args.tiny)
                except Exception as e:
                    traceback.print_exc()
                    checks.append(CheckRow(fn.__name__, name, str(dtype), float("nan"), False, _short(e)))
    failed = sum(not (r.ok and not math.isnan(r.err)) for r in checks)
    flush(f"## Correctness ({len(checks) - failed}/{len(checks)} pass)\n\n"
          + format_table(CHECK_HEADER, [r.cells() for r in checks]) + "\n")
    if not args.skip_bench:
        dtype = dtypes[0]
        rows = []
        for name in names:
            rows += [(r, None) for r in bench_decode(name, table[name], dtype, dev, args.tiny, args.sweep)]
        flush(f"## Decode attention ({dtype}; GB/s of K+V read)\n\n"
              + format_table(BENCH_HEADER, [r.cells(b) for r, b in rows]) + "\n")
        rows = []
        for name in names:
            rows += bench_prefill(name, table[name], dtype, dev, args.tiny, args.sweep)
        flush(f"## Prefill attention ({dtype}; causal TFLOP/s, 4·d·H per attended pair)\n\n"
              + format_table(BENCH_HEADER, [r.cells(b) for r, b in rows]) + "\n")
        rows = [r for name in names for r in bench_sampling(name, table[name], dev, args.tiny, args.sweep)]
        flush("## Sampling (float32 logits; GB/s of logits read once)\n\n"
              + format_table(BENCH_HEADER, [r.cells() for r in rows]) + "\n")
        rows = [r for name in names for r in bench_rope_store(name, table[name], dtype, dev, args.tiny)]
        flush(f"## RoPE + KV store ({dtype}; GB/s of q, k, v read and written once)\n\n"
              + format_table(BENCH_HEADER, [r.cells() for r in rows]) + "\n")
        rows = [r for name in names for r in bench_lora(name, table[name], dtype, dev, args.tiny)]
        flush(f"## LoRA ({dtype}; shrink + expand against the projection's GEMM, TFLOP/s of each one's own work)\n\n"
              + format_table(BENCH_HEADER, [r.cells() for r in rows]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
