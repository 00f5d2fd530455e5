"""Compile one Triton kernel for an H100/H200 (sm_90a) on a machine without a GPU, and report what costs device
time to find out otherwise: registers and spills (ptxas -v), shared memory, the shared-memory buffers and waits of
the pipelined loop (TTGIR), and an instruction histogram of the whole kernel and of its largest loop (SASS), with
the loop's wgmma waits (a `gsb0, 0x0` after each wgmma serializes them) and ptxas's performance notes (C7515).

    python benchmarks/kernels/triton_sass.py vserve.kernels.triton_attention:_decode_partition_kernel \\
        --types q_ptr=*bf16,kc_ptr=*fp8e4nv,vc_ptr=*fp8e4nv,bt_ptr=*i32,ctx_ptr=*i32,out_ptr=*bf16,acc_ptr=*fp32,\\
m_ptr=*fp32,l_ptr=*fp32,count_ptr=*i32,qk_scale=fp32 \\
        --const D=128,GROUP=4,GROUP_P=16,BLOCK_SIZE=16,BLOCK_N=128,BLOCK_D=128,PARTITION=2048,FUSED_REDUCE=True,\\
DOT_PRECISION=tf32,F16_DOT=True,V_HW_CVT=True --num-warps 4 --num-stages 2

Arguments not named in --types or --const are int32; pointers and stride_* arguments are declared 16-divisible
(as Triton specializes them at run time) except those in --no-div, and so are the integers named in --div (a row
length that Triton would find divisible at run time: without it masked loads are not vectorized). ptxas and
cuobjdump come with the triton wheel.
The listing files (ttgir, ptx, sass) and the numbers printed (triton_sass.json) go to --out. --cpu-smoke compiles
triton_ops' SiLU-and-mul kernel. Nothing runs the kernel, so TRITON_INTERPRET is ignored here.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SMOKE = ["vserve.kernels.triton_ops:_silu_and_mul_kernel", "--types", "x_ptr=*bf16,out_ptr=*bf16", "--const",
         "BLOCK=1024,PDL=False"]


def _pairs(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split(",") if kv) if text else {}


def _value(v: str):
    try:
        return ast.literal_eval(v)
    except (ValueError, SyntaxError):
        return v  # a bare string, e.g. tf32


def _histogram(lines: list[str]) -> collections.Counter:
    ops: collections.Counter = collections.Counter()
    for text in lines:
        text = re.sub(r"^@!?U?P\w+\s+", "", text)  # predicate
        ops[text.split()[0]] += 1
    return ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", nargs="?", help="module:function, e.g. vserve.kernels.triton_ops:_rms_norm_kernel")
    ap.add_argument("--types", default="", help="name=type,... (*bf16, *fp8e4nv, *i32, fp32, i64, ...)")
    ap.add_argument("--const", default="", help="name=value,... for the constexpr arguments")
    ap.add_argument("--no-div", default="", help="pointer/stride arguments not to declare 16-divisible")
    ap.add_argument("--div", default="", help="other integer arguments to declare 16-divisible (e.g. N, K)")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--out", default="/tmp/triton_sass")
    ap.add_argument("--cpu-smoke", action="store_true", help=f"compile {SMOKE[0]}")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args = ap.parse_args([*SMOKE, "--out", args.out])
    if not args.kernel:
        ap.error("give the kernel as module:function")
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never run: @triton.jit must build real kernels

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod_name, fn_name = args.kernel.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    types, consts = _pairs(args.types), {k: _value(v) for k, v in _pairs(args.const).items()}
    no_div, div = set(filter(None, args.no_div.split(","))), set(filter(None, args.div.split(",")))
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    untyped = [n for n in fn.arg_names if n.endswith("_ptr") and n not in types and n not in consts]
    if untyped:
        ap.error(f"give the element type of {', '.join(untyped)} in --types")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if (t.startswith("*") or n.startswith("stride") or n in div) and n not in no_div and t != "constexpr"}
    options = dict(num_warps=args.num_warps, num_stages=args.num_stages)
    if args.maxnreg:
        options["maxnreg"] = args.maxnreg
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=options)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{fn_name}.ttgir").write_text(k.asm["ttgir"])
    (out / f"{fn_name}.ptx").write_text(k.asm["ptx"])
    (out / f"{fn_name}.cubin").write_bytes(k.asm["cubin"])
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = subprocess.run([str(bindir / "ptxas"), "-arch=sm_90a", "-v", str(out / f"{fn_name}.ptx"), "-o",
                            os.devnull], capture_output=True, text=True).stderr
    sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(out / f"{fn_name}.cubin")], capture_output=True,
                          text=True).stdout
    (out / f"{fn_name}.sass").write_text(sass)

    usage = re.search(r"Used (\d+) registers", ptxas)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    spilled = f"{spills.group(1)}/{spills.group(2)}" if spills else "?"
    print(f"registers {usage.group(1) if usage else '?'}, spill stores/loads {spilled} bytes, "
          f"shared memory {k.metadata.shared} bytes")
    ttgir = k.asm["ttgir"]
    print("shared buffers:", ", ".join(sorted(set(re.findall(r"memdesc<(\d+x[\dx]+x\w+)", ttgir)))) or "none",
          "| async waits (num):", ", ".join(re.findall(r"async_wait[^\n]*?num = (\d+)", ttgir)) or "none")
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    print(f"kernel: {len(ins)} instructions;", ", ".join(f"{op} {n}" for op, n in _histogram([t for _, t in ins])
                                                        .most_common(16)))
    summary = dict(kernel=args.kernel, registers=int(usage.group(1)) if usage else None,
                   spill_bytes=[int(spills.group(1)), int(spills.group(2))] if spills else None,
                   shared_bytes=k.metadata.shared, instructions=len(ins))
    loops = []  # (start, end) of backward branches
    for addr, text in ins:
        targets = re.findall(r"0x[0-9a-f]+", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < addr:
            loops.append((int(targets[-1], 16), addr))
    if loops:
        start, end = max(loops, key=lambda se: se[1] - se[0])
        body = [t for a, t in ins if start <= a <= end]
        print(f"largest loop ({hex(start)}-{hex(end)}): {len(body)} instructions;",
              ", ".join(f"{op} {n}" for op, n in _histogram(body).most_common(24)))
        summary["largest_loop_instructions"] = len(body)
        waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", "\n".join(body)))
        if waits:  # 0x0: the next wgmma waits for every one before it (serialized); more: that many stay in flight
            print("wgmma waits in the loop:", ", ".join(f"{n} x {w}" for w, n in sorted(waits.items())))
            summary["loop_wgmma_waits"] = dict(waits)
    notes = [line.split(": ", 1)[1] for line in ptxas.splitlines() if "Performance Loss" in line]
    for note in notes:  # e.g. C7515: ptxas serialized the wgmma instructions
        print("ptxas:", note)
    summary["ptxas_notes"] = notes
    (out / "triton_sass.json").write_text(json.dumps(summary, indent=1))
    print(f"listings in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
