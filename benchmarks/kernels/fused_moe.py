"""The grouped fused MoE kernel (kernels/triton_fused_moe.py) on Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite MoE
layer shapes: checked against its reference in bf16, then timed beside the per-row kernel (kernels/triton_moe.py) and
the torch reference, at prefill (4,096 tokens) and decode (1..256 tokens) batch sizes.

    python benchmarks/kernels/fused_moe.py --out $OUT                 # H200, a few minutes
    python benchmarks/kernels/fused_moe.py --out $OUT --tune          # + launch configs: OUT/fused_moe_configs.json
    python benchmarks/kernels/fused_moe.py --cpu-smoke --out /tmp/moe # tiny shapes, TRITON_INTERPRET=1

Check: max |fused - ref| / max |ref| (ref: fused_moe_ref in fp32 on the same bf16 inputs) within max(1.6e-2, 2x the
bf16 torch reference's own error), for the grouped and the per-row kernel, routing drawn from a random router (uneven
loads) with one expert left without tokens. Time (ms per MoE layer, weights out of L2 as a decode step finds them):
`fused` as the engine calls it (the table's config; per-row up to its per_row_max_tokens), `grouped` forced
(per_row_max_tokens=0), `per_row`, `ref` (torch, eager). TFLOP/s = 6 M k H I / time (gate, up, down);
GB/s = (bytes of the experts the batch routes to: 3 H I each, + activations) / time; against the H200's ceilings
(989 bf16 dense TFLOP/s, 4.8 TB/s). --tune: each shape and batch size over CONFIG_GRID, the fastest config per
batch bucket and per_row_max_tokens (the largest decode batch up to which the per-row kernel stayed faster), written
in kernels/fused_moe_configs.json's form for the lead to copy in. JSON: OUT/fused_moe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

SHAPES = {  # name: (experts, top-k, hidden H, expert intermediate I)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
PREFILL_ROWS = [4096]
DECODE_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
TOL = 1.6e-2
CEILINGS = {"bf16_TFLOPs": 989.0, "HBM_GBps": 4800.0}  # H200 SXM (profiles/h200.yaml)
CONFIG_GRID = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=st)
               for bm, bn, bk, g, w, st in ((16, 32, 64, 1, 4, 3), (16, 64, 64, 1, 4, 3), (16, 128, 64, 1, 4, 4),
                                            (16, 64, 128, 1, 4, 3), (32, 64, 64, 8, 4, 3), (32, 128, 64, 8, 4, 3),
                                            (64, 64, 32, 8, 4, 3), (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 8, 4),
                                            (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3))]


def routing(M: int, E: int, k: int, dev: str, seed: int):
    """top-k of a random router's softmax (a skew makes loads uneven; the last expert gets no token)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M, E, generator=g) - 0.3 * torch.rand(E, generator=g)
    if E > k:
        logits[:, -1] = -1e9
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(dev), ids.to(dev)


def weights(E: int, H: int, I: int, dev: str, dtype):
    return ((torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(dtype),
            (torch.randn(E, H, I, device=dev) * I ** -0.5).to(dtype))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)


def check(dev: str, shapes: dict, rows: list[int], dtype) -> list[dict]:
    from vserve.kernels.moe_ref import fused_moe_ref
    from vserve.kernels.triton_fused_moe import fused_moe
    from vserve.kernels.triton_moe import fused_moe_per_row

    out = []
    for name, (E, k, H, I) in shapes.items():
        w13, w2 = weights(E, H, I, dev, dtype)
        for M in rows:
            x = torch.randn(M, H, device=dev).to(dtype)
            tw, ids = routing(M, E, k, dev, M)
            ref = fused_moe_ref(x.float(), w13.float(), w2.float(), tw, ids)
            torch_err = rel_err(fused_moe_ref(x, w13, w2, tw, ids), ref)
            row = dict(shape=name, M=M, dtype=str(dtype).removeprefix("torch."), torch_rel_err=torch_err)
            for path, fn in (("grouped", partial(fused_moe, per_row_max_tokens=0)), ("per_row", fused_moe_per_row)):
                row[f"{path}_rel_err"] = rel_err(fn(x, w13, w2, tw, ids), ref)
            row["ok"] = all(row[f"{p}_rel_err"] <= max(TOL, 2 * torch_err) for p in ("grouped", "per_row"))
            out.append(row)
        del w13, w2
    return out


def time_rows(dev: str, shapes: dict, rows: list[int], dtype, cold_bytes: int, timing: dict,
              tune: bool) -> tuple[list[dict], dict]:
    from timing import copies, time_ms

    from vserve.kernels.moe_ref import fused_moe_ref
    from vserve.kernels.triton_fused_moe import fused_moe, get_config
    from vserve.kernels.triton_moe import fused_moe_per_row

    out, tuned = [], {}
    for name, (E, k, H, I) in shapes.items():
        esize = torch.finfo(dtype).bits // 8
        ws = copies(lambda E=E, H=H, I=I: weights(E, H, I, dev, dtype), 3 * E * H * I * esize, cold_bytes)
        best_cfgs, per_row_faster = {}, []
        for M in rows:
            x = torch.randn(M, H, device=dev).to(dtype)
            tw, ids = routing(M, E, k, dev, M)
            used = int(ids.unique().numel())
            nbytes = used * 3 * H * I * esize + 2 * M * H * esize + M * k * I * esize * 2

            def call(fn, w13, w2, _x=x, _tw=tw, _ids=ids, **kw):
                fn(_x, w13, w2, _tw, _ids, **kw)

            row = dict(shape=name, E=E, k=k, H=H, I=I, M=M, experts_used=used, config=get_config(E, I, H, M),
                       fused_ms=time_ms(partial(call, fused_moe), dev, ws, **timing),
                       grouped_ms=time_ms(partial(call, fused_moe, per_row_max_tokens=0), dev, ws, **timing),
                       per_row_ms=time_ms(partial(call, fused_moe_per_row), dev, ws, **timing),
                       ref_ms=time_ms(partial(call, fused_moe_ref), dev, ws[:1], graph=False, **timing))
            flops = 6 * M * k * H * I
            for p in ("fused", "grouped", "per_row", "ref"):
                row[f"{p}_TFLOPs"] = flops / (row[f"{p}_ms"] * 1e-3) / 1e12
                row[f"{p}_GBps"] = nbytes / (row[f"{p}_ms"] * 1e-3) / 1e9
            if tune:
                timed = []
                for cfg in CONFIG_GRID:
                    try:
                        timed.append(dict(ms=time_ms(partial(call, fused_moe, config=cfg, per_row_max_tokens=0), dev,
                                                     ws, **timing), **cfg))
                    except Exception as e:  # out of shared memory or registers: keep the others
                        timed.append(dict(error=f"{type(e).__name__}: {str(e)[:120]}", **cfg))
                row["grid"] = sorted(timed, key=lambda t: t.get("ms", float("inf")))
                best = row["grid"][0]
                best_cfgs[str(M)] = {key: v for key, v in best.items() if key not in ("ms", "error")}
                per_row_faster.append((M, row["per_row_ms"] < best.get("ms", float("inf"))))
            out.append(row)
            print(f"{name:>17} M={M:<5} " + "  ".join(f"{p} {row[p + '_ms']:.4f} ms" for p in
                                                      ("fused", "grouped", "per_row", "ref"))
                  + f"  grouped {row['grouped_TFLOPs']:.1f} TFLOP/s {row['grouped_GBps']:.0f} GB/s", flush=True)
        if tune:
            limit = 0
            for M, faster in sorted(per_row_faster):
                if not faster:
                    break
                limit = M
            tuned[f"E={E},I={I},H={H}"] = {"configs": best_cfgs, "per_row_faster_up_to": limit}
        del ws
    return out, tuned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, DECODE_ROWS + PREFILL_ROWS)), help="token counts M")
    ap.add_argument("--tune", action="store_true", help="also sweep CONFIG_GRID and write fused_moe_configs.json")
    ap.add_argument("--cold-mib", type=int, default=256, help="weight copies cycled per timed pass (0: one, hot)")
    from timing import parse_args

    args = parse_args(ap, argv, "tiny shapes on the CPU under TRITON_INTERPRET=1")
    if args is None:
        return 2
    from timing import smoke_iters

    if args.cpu_smoke:  # fp16: the interpreter's tl.dot on bf16 is wrong
        dev, shapes, rows, dtype, cold = "cpu", {"tiny": (4, 2, 64, 32), "tiny-top8": (8, 8, 32, 48)}, [1, 3, 40], \
            torch.float16, 0
        CONFIG_GRID[:] = CONFIG_GRID[:2]
    else:
        dev, shapes, dtype, cold = "cuda", SHAPES, torch.bfloat16, args.cold_mib << 20
        rows = [int(m) for m in args.rows.split(",")]
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke: the numbers mean nothing)",
                 "torch": torch.__version__, "cold_bytes": cold, "ceilings": CEILINGS}
    res["check"] = check(dev, shapes, sorted({rows[0], rows[-1], 5, 40} if args.cpu_smoke else
                                             {1, 7, 64, 256, 4096}), dtype)
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"check: {len(res['check']) - len(bad)}/{len(res['check'])} ok" + "".join(f"\n  FAIL {r}" for r in bad))
    res["time"], tuned = time_rows(dev, shapes, rows, dtype, cold, smoke_iters(args.cpu_smoke), args.tune)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_moe.json").write_text(json.dumps(res, indent=1))
    if args.tune:
        from vserve.kernels.triton_fused_moe import moe_configs

        table = dict(moe_configs())
        table["shapes"] = {**table["shapes"], **{key: t["configs"] for key, t in tuned.items()}}
        table["per_row_max_tokens"] = min(t["per_row_faster_up_to"] for t in tuned.values())
        (out / "fused_moe_configs.json").write_text(json.dumps(table, indent=1))
        print(f"tuned table: {out / 'fused_moe_configs.json'} (per_row_max_tokens {table['per_row_max_tokens']})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
