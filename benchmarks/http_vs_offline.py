"""HTTP throughput of `vserve serve` against offline `LLM.generate` on the same prompts and concurrency.

    python benchmarks/http_vs_offline.py [--model M] [--num-prompts 32] [--output-len 64] [--dtype float32]
                                         [--no-engine-process] [--out DIR] [--cpu-smoke]

Starts a real server process on loopback, sends every prompt at once (streaming off), and runs the same
prompts offline in this process afterwards; prints output tok/s for both and their ratio (and writes them to
DIR/http_vs_offline.json with --out). --cpu-smoke: 4 prompts of 16 tokens, 8 new each (the commands run, nothing is
measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_run(url: str, prompts: list[list[int]], out_len: int) -> float:
    async with httpx.AsyncClient(timeout=600) as http:
        body = {"max_tokens": out_len, "ignore_eos": True, "temperature": 1.0}
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[http.post(url + "/v1/completions", json={**body, "prompt": p}) for p in prompts])
        dt = time.perf_counter() - t0
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    assert sum(r.json()["usage"]["completion_tokens"] for r in rs) == out_len * len(prompts)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-engine-process", action="store_true", help="serve with the engine loop on a thread")
    ap.add_argument("--out", default=None, help="a folder for http_vs_offline.json")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.num_prompts, args.input_len, args.output_len = 4, 16, 8
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 49000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    port = free_port()
    cmd = [sys.executable, "-m", "vserve.cli.main", "serve", "--port", str(port), "--dtype", args.dtype]
    if args.model:
        cmd.append(args.model)
    if args.no_engine_process:
        cmd.append("--no-engine-process")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "VSERVE_NO_PROGRESS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(http_run(url, prompts[:2], 4))  # warm-up
        http_s = asyncio.run(http_run(url, prompts, args.output_len))
    finally:
        proc.terminate()
        proc.wait(60)
    from vserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    offline_s = time.perf_counter() - t0
    n = args.num_prompts * args.output_len
    print(f"requests {args.num_prompts} x {args.input_len} in / {args.output_len} out, concurrency "
          f"{args.num_prompts}, engine {'thread' if args.no_engine_process else 'process'}")
    print(f"http     {http_s:7.2f} s  {n / http_s:8.1f} output tok/s")
    print(f"offline  {offline_s:7.2f} s  {n / offline_s:8.1f} output tok/s")
    print(f"http / offline = {offline_s / http_s:.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "http_vs_offline.json"), "w") as f:
            json.dump({"requests": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                       "engine": "thread" if args.no_engine_process else "process", "http_s": http_s,
                       "offline_s": offline_s, "http_over_offline": offline_s / http_s}, f, indent=1)


if __name__ == "__main__":
    main()
