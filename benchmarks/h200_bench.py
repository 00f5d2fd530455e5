"""Issue 6, acceptance 2, in one call on the H200: the `vserve bench` records.

    PYTHONPATH=... python benchmarks/h200_bench.py --out $OUT [--sections a,b,c,d] [--paging-shape small|8b]
    python benchmarks/h200_bench.py --cpu-smoke --out /tmp/h200_bench_smoke   # CPU, tiny model (--smoke too)

(a) `vserve bench serve` at concurrency 256 against a real `vserve serve` process on 127.0.0.1 (the engine in its
    own process unless --no-engine-process; the JSON's server.engine says which ran), and `bench throughput`'s
    offline run of the same requests (token ids, same seed): HTTP / offline (goal >= 0.92).
(b) 256 requests sharing a 2,048-token prefix (`--dataset prefix`), offline, prefix caching on vs off (goal >= 3x).
(c) `vserve bench experiment paging`: paged (vserve) vs contiguous (HF static batch) on equal-token mixes.
(d) `vserve bench serve --sweep-concurrency 1,8,32,128 --plot` on the same server: OUT/plots/*.png.

Random weights (--load-format dummy, bf16) in the Llama-3-8B shape. `bench serve` and the server need a tokenizer
(the server streams text; with --skip-tokenizer-init it streams one empty chunk per request, which bench serve
counts as a failure), and none is available offline there: each model folder gets common.py's synthetic word-level
tokenizer over the model's whole vocabulary (token i is the word `t{i}`, Llama-3's special ids special), so both
sides draw the same token-id workload and both pay a real incremental detokenization per token.
The clients are the CLI itself (`python -m vserve.cli.main bench serve ... --json`, a separate process); the
offline runs call `bench throughput`'s own functions on one engine; the paging table calls the command's function.
Order, whatever --sections says: the server phase (a's HTTP run, then d), then the offline engines (a, b on, b off),
then c. Each side first runs one untimed batch (first uses of kernels) and the same warm-up requests.
Full JSON in OUT/h200_bench.json, written after every step; a short table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import resource
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from common import CLI, LLAMA3_8B, SMOLLM2, TINY, model_folder, server  # benchmarks/ is sys.path[0]


@dataclass(slots=True)
class Plan:
    """Every size of the run: the H200 defaults, or `smoke()`'s for a CPU check."""

    model: dict
    paging_model: dict
    dtype: str = "bfloat16"
    device: str | None = None
    max_num_seqs: int = 256
    # (a): prompts U[100,1024] random token ids, a fixed output length, all in flight at once.
    serve_prompts: int = 256
    serve_input: str = "100:1024"
    serve_output: str = "256"
    concurrency: int = 256
    warmups: int = 4  # untimed requests before (a)'s and (b)'s runs, the same on both sides of a ratio
    prime_prompts: int = 32  # one untimed batch on each side first: kernels' first uses stay out of every run
    # (b): one shared prefix plus a distinct suffix per request.
    prefix_prompts: int = 256
    prefix_len: int = 2048
    suffix_len: str = "32"
    prefix_output: str = "64"
    # (c): the command's default mixes (8,192 tokens each).
    mixes: str = "4x2048,32x256,16x512,2x2048+16x256"
    paging_output: int = 64
    paging_repeats: int = 3
    # (d): one run per level, the same number of requests at each.
    sweep: str = "1,8,32,128"
    sweep_prompts: int = 128
    sweep_input: str = "100:1024"
    sweep_output: str = "32"
    sweep_seed: int = 100  # not (a)'s seed 0: the server's prefix cache holds (a)'s prompts
    server_start_s: float = 300.0
    client_timeout_s: float = 400.0
    engine_process: bool = True  # `vserve serve`'s default; False: --no-engine-process (the loop on a thread)

    @classmethod
    def smoke(cls) -> Plan:
        return cls(TINY, TINY, dtype="float32", device="cpu", max_num_seqs=16, serve_prompts=8, serve_input="8:32",
                   serve_output="8", concurrency=8, prefix_prompts=8, prefix_len=64, suffix_len="8",
                   prefix_output="4", mixes="2x128,16x16", paging_output=8, paging_repeats=1, sweep="1,2,4",
                   sweep_prompts=6, sweep_input="8:32", sweep_output="6", warmups=2, prime_prompts=4,
                   server_start_s=180.0)


# ---- the CLI as a client -------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), to tell a CPU-bound server from a busy GPU."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def engine_mode(log: Path) -> dict:
    """Which engine the server runs, from its start-up log: {"mode": "process", "pid": P} or {"mode": "thread"}."""
    found = re.search(r"engine process started \(pid (\d+)\)", log.read_text(errors="replace"))
    return {"mode": "process", "pid": int(found.group(1))} if found else {"mode": "thread", "pid": None}


def bench_cli(args: list[str], timeout: float, server_pid: int, saved: Path | None = None,
              engine_pid: int | None = None) -> dict:
    """`vserve bench ARGS --json` in a fresh process: its JSON object, plus the CPU seconds the client, the
    server (its HTTP process) and its engine process (if it has one) spent meanwhile. With `saved` (its
    --save-result file), a run whose later step (the plot) failed still gives its numbers, with the error under
    `cli_error`."""
    def delta(pid, before):
        after = cpu_seconds(pid) if pid is not None else None
        return after - before if after is not None and before is not None else None

    client0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    server0, engine0 = cpu_seconds(server_pid), cpu_seconds(engine_pid) if engine_pid is not None else None
    r = subprocess.run([*CLI, "bench", *args, "--json"], capture_output=True, text=True, timeout=timeout)
    client1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    cpu = {"wall_s": wall, "client_cpu_s": client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime,
           "server_cpu_s": delta(server_pid, server0), "engine_cpu_s": delta(engine_pid, engine0)}
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "cpu": cpu}
    error = f"vserve bench {args[0]} exited {r.returncode}: {r.stderr[-2000:]}"
    if saved is not None and saved.is_file():
        report = json.loads(saved.read_text())
        return {"config": report["config"], "runs": [{k: v for k, v in run.items() if k != "requests"}
                                                    for run in report["runs"]], "cpu": cpu, "cli_error": error}
    raise RuntimeError(error)


# ---- offline: `bench throughput`'s functions on an engine built once ---------------------------------------
def engine_args(plan: Plan, model: str, **overrides) -> dict:
    """Every engine flag as the CLI passes it (None: not given), as `vserve bench throughput` would build."""
    from vserve.cli.engine_args import ENGINE_FLAGS

    given = {"model": model, "load_format": "dummy", "dtype": plan.dtype, "device": plan.device,
             "max_num_seqs": plan.max_num_seqs, **overrides}
    return {f.name: given.get(f.name) for f in ENGINE_FLAGS}


def offline_throughput(llm, dataset: str, num_prompts: int, input_len: str, output_len: str, warmups: int,
                       seed: int = 0, **prefix) -> dict:
    """What `vserve bench throughput --json` reports for these flags (and --seed), run on `llm`.

    First `bench serve --num-warmups N`'s warm-up (prompt i reversed, at most 16 tokens, one at a time), so the
    offline and the HTTP run start equally warm: `run_vserve`'s own warm-up (an 8-token prompt) leaves first-use
    costs of longer prompts in the timed run (on the CPU a fresh engine's first run is several times slower).
    """
    from vserve import SamplingParams
    from vserve.cli import bench

    engine, tok = llm.llm_engine, llm.get_tokenizer()
    in_len, out_len = bench.parse_len("--input-len", input_len), bench.parse_len("--output-len", output_len)
    vocab = min(engine.model_config.vocab_size, len(tok))
    w = bench.make_workload(dataset, seed=seed, num_prompts=num_prompts, input_len=in_len, output_len=out_len,
                            vocab_size=vocab, special_ids=bench.special_ids(tok),
                            encode=lambda t: tok.encode(t, add_special_tokens=False), max_len=engine.max_model_len,
                            **prefix)
    longest = max(len(p) + o for p, o in zip(w.prompts, w.output_lens))
    if longest > engine.max_model_len:
        raise ValueError(f"a request of {longest} tokens exceeds max_model_len {engine.max_model_len}")
    for i in range(warmups):
        j = i % len(w.prompts)
        llm.generate([w.prompts[j][::-1]], SamplingParams(max_tokens=min(w.output_lens[j], 16), ignore_eos=True),
                     use_tqdm=False)
    stats0 = engine.stats()
    result = bench.run_vserve(llm, w).as_dict()
    stats = engine.stats()
    return {**result, "dataset": dataset, "input_len": list(in_len), "output_len": list(out_len), "seed": seed,
            "preemptions": stats.num_preemptions - stats0.num_preemptions}


def free_memory() -> dict:
    """Collect the engine just dropped and give its memory back, so the next engine's planner sees it free."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return {}
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30, "free_gib": free / 2**30,
            "total_gib": total / 2**30}


# ---- the run --------------------------------------------------------------------------------------------------
class Recorder:
    """Results by section; each step's failure is kept under `<step>_error`; the JSON is rewritten after each."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.results = out, {"sections_s": {}, "skipped": []}
        self.deadline = time.monotonic() + budget_s
        out.mkdir(parents=True, exist_ok=True)

    def enough_time(self, step: str, need_s: float) -> bool:
        """False (and the step listed under `skipped`) when fewer than need_s seconds of the budget are left."""
        left = self.deadline - time.monotonic()
        if left < need_s:
            self.results["skipped"].append(f"{step}: {left:.0f} s of the budget left, it needs about {need_s:.0f}")
            self.write()
        return left >= need_s

    @contextlib.contextmanager
    def step(self, section: str, name: str):
        part = self.results.setdefault(section, {})
        t0 = time.perf_counter()
        try:
            yield part
        except Exception as e:  # keep every other step's numbers
            part[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"{section}.{name} failed: {e!r}"[:500], flush=True)
        self.results["sections_s"][f"{section}.{name}"] = round(time.perf_counter() - t0, 2)
        self.write()

    def write(self) -> None:
        (self.out / "h200_bench.json").write_text(json.dumps(self.results, indent=1, default=str))


def run_server_phase(rec: Recorder, plan: Plan, folder: str, sections: set[str]) -> None:
    """(a)'s HTTP run and (d)'s sweep against one server (nothing else holds the GPU meanwhile)."""
    log = Path(tempfile.mkdtemp(prefix="vserve-bench-")) / "server.log"
    serve_args = [folder, "--load-format", "dummy", "--dtype", plan.dtype, "--max-num-seqs", str(plan.max_num_seqs)]
    serve_args += ["--device", plan.device] if plan.device else []
    serve_args += ["--engine-process" if plan.engine_process else "--no-engine-process"]
    common = ["--token-ids", "--tokenizer", folder]
    t0 = time.perf_counter()
    try:
        with server(serve_args, log, plan.server_start_s) as (url, pid):
            engine = engine_mode(log)
            rec.results["server"] = {"cli": "vserve serve " + " ".join(serve_args), "engine": engine,
                                     "start_s": round(time.perf_counter() - t0, 2)}
            with rec.step("server", "prime") as part:  # seed 7: no prompt of a later run, so no cache hits
                part["prime"] = bench_cli(["serve", "--base-url", url, *common, "--num-prompts",
                                           str(plan.prime_prompts), "--input-len", plan.serve_input, "--output-len",
                                           "16", "--num-warmups", "0", "--seed", "7"], plan.client_timeout_s,
                                          pid, engine_pid=engine["pid"])["runs"][0]["duration_s"]
            if "a" in sections:
                with rec.step("a", "serve") as part:
                    args = ["serve", "--base-url", url, *common, "--num-prompts", str(plan.serve_prompts),
                            "--input-len", plan.serve_input, "--output-len", plan.serve_output,
                            "--max-concurrency", str(plan.concurrency), "--num-warmups", str(plan.warmups),
                            "--seed", "0"]
                    part["serve_cli"] = "vserve bench " + " ".join(args)
                    report = bench_cli(args, plan.client_timeout_s, pid, engine_pid=engine["pid"])
                    part["serve"], part["serve_cpu"] = report["runs"][0], report["cpu"]
                    part["engine"] = engine["mode"]
            if "d" in sections:
                with rec.step("d", "sweep") as part:
                    saved = log.with_name("sweep_result.json")
                    args = ["serve", "--base-url", url, *common, "--num-prompts", str(plan.sweep_prompts),
                            "--input-len", plan.sweep_input, "--output-len", plan.sweep_output,
                            "--sweep-concurrency", plan.sweep, "--num-warmups", "2", "--seed", str(plan.sweep_seed),
                            "--save-result", str(saved), "--plot", str(rec.out / "plots")]
                    part["cli"] = "vserve bench " + " ".join(args)
                    part.update(bench_cli(args, plan.client_timeout_s, pid, saved, engine["pid"]))
                    part["plots"] = sorted(p.name for p in (rec.out / "plots").glob("*.png"))
    except Exception:
        rec.results.setdefault("server", {})["error"] = traceback.format_exc()[-3000:]
        print("server phase failed:", rec.results["server"]["error"][-500:], flush=True)
    rec.results.setdefault("server", {})["log_tail"] = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    rec.write()


def wait_gpu_released(limit_s: float = 30.0) -> float | None:
    """Free fraction of GPU memory once the stopped server's memory is back (or limit_s passed); None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    deadline = time.monotonic() + limit_s
    while True:
        free, total = torch.cuda.mem_get_info()
        if free > 0.95 * total or time.monotonic() > deadline:
            return free / total
        time.sleep(0.5)


def run_offline_phase(rec: Recorder, plan: Plan, folder: str, sections: set[str]) -> None:
    """(a)'s offline run and (b) with caching on, on one engine; (b) with caching off on a second."""
    from vserve.cli.engine_args import build_llm

    prefix = dict(num_prompts=plan.prefix_prompts, input_len=plan.suffix_len, output_len=plan.prefix_output,
                  warmups=plan.warmups, prefix_len=plan.prefix_len, num_prefixes=1)
    for caching in (True, False):
        if not caching and ("b" not in sections or not rec.enough_time("b.caching_off", 40)):
            break
        llm = None
        with rec.step("engines", f"build_caching_{'on' if caching else 'off'}"):
            llm = build_llm(engine_args(plan, folder, enable_prefix_caching=caching))
        if llm is not None and caching:
            with rec.step("engines", "prime") as part:  # as the server was primed, before anything is timed
                part["prime"] = offline_throughput(llm, "random", plan.prime_prompts, plan.serve_input, "16", 0,
                                                   seed=7)["elapsed_s"]
        if llm is not None:
            if caching and "a" in sections:
                with rec.step("a", "offline") as part:
                    part["offline"] = offline_throughput(llm, "random", plan.serve_prompts, plan.serve_input,
                                                         plan.serve_output, plan.warmups)
            if "b" in sections:
                with rec.step("b", f"caching_{'on' if caching else 'off'}") as part:
                    part[f"caching_{'on' if caching else 'off'}"] = offline_throughput(llm, "prefix", **prefix)
        del llm
        rec.results.setdefault("memory_after_free", {})[f"caching_{'on' if caching else 'off'}"] = free_memory()
        rec.write()
    a, b = rec.results.get("a", {}), rec.results.get("b", {})
    if "serve" in a and "offline" in a:
        a["http_over_offline"] = a["serve"]["output_throughput"] / a["offline"]["output_tokens_per_s"]
        a["same_tokens"] = (a["serve"]["total_input_tokens"] == a["offline"]["prompt_tokens"]
                            and a["serve"]["total_output_tokens"] == a["offline"]["output_tokens"])
    if "caching_on" in b and "caching_off" in b:
        b["on_over_off"] = b["caching_on"]["output_tokens_per_s"] / b["caching_off"]["output_tokens_per_s"]
    b["cli"] = (f"vserve bench throughput --dataset prefix --prefix-len {plan.prefix_len} --num-prefixes 1 "
                f"--input-len {plan.suffix_len} --output-len {plan.prefix_output} --num-prompts {plan.prefix_prompts}"
                " [--no-enable-prefix-caching]") if "b" in sections else None
    if "a" in sections:
        a["offline_cli"] = (f"vserve bench throughput --num-prompts {plan.serve_prompts} --input-len {plan.serve_input}"
                            f" --output-len {plan.serve_output} --max-num-seqs {plan.max_num_seqs} --json")
    rec.write()


def run_paging(rec: Recorder, plan: Plan) -> None:
    """`vserve bench experiment paging --json`, the command's own function, in this process."""
    from vserve.cli import bench_experiment

    with rec.step("c", "paging") as part:
        folder = model_folder(plan.paging_model)
        kwargs = dict(mixes=plan.mixes, output_len=plan.paging_output, repeats=plan.paging_repeats, contiguous=True,
                      as_json=True, print_config=False, **engine_args(plan, folder, max_num_seqs=None))
        part["cli"] = (f"vserve bench experiment paging --mixes {plan.mixes} --output-len {plan.paging_output} "
                       f"--repeats {plan.paging_repeats} --json")
        part["shape"] = {k: plan.paging_model[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            bench_experiment.paging(**kwargs)
        part.update(json.loads([line for line in buf.getvalue().splitlines() if line.startswith("{")][-1]))
    rec.results.setdefault("memory_after_free", {})["paging"] = free_memory()


def summary(r: dict) -> list[str]:
    def row(label: str, value, fmt: str = "{:,.1f}", goal: str = "") -> str:
        return f"{label:46} {fmt.format(value) if isinstance(value, int | float) else '-':>12}  {goal}"

    a, b, c, d = (r.get(k, {}) for k in "abcd")
    serve, offline = a.get("serve", {}), a.get("offline", {})
    on, off = b.get("caching_on", {}), b.get("caching_off", {})
    lines = [f"{'record':46} {'value':>12}  goal"]
    if a:
        lines += [row(f"(a) HTTP output tok/s, concurrency {serve.get('max_concurrency')}",
                      serve.get("output_throughput"), goal=f"engine: {a.get('engine', '-')}"),
                  row("(a) offline output tok/s, same requests", offline.get("output_tokens_per_s")),
                  row("(a) HTTP / offline", a.get("http_over_offline"), "{:.3f}", ">= 0.92")]
    if b:
        lines += [row("(b) shared prefix, caching on, output tok/s", on.get("output_tokens_per_s")),
                  row("(b) shared prefix, caching off, output tok/s", off.get("output_tokens_per_s")),
                  row("(b) on / off", b.get("on_over_off"), "{:.2f}x", ">= 3x")]
    for x in c.get("rows", []):
        lines.append(row(f"(c) {x['backend'][:22]} {x['mix']}", x["tokens_per_s"], goal=f"tok/s, CV "
                         f"{x['throughput_cv']:.3f}, p90 {x['p90_latency_s']:.3f} s, "
                         f"KV peak {x['kv_peak_bytes'] / 2**20:,.1f} MiB"))
    for x in d.get("runs", []):
        lines.append(row(f"(d) concurrency {x['max_concurrency']}", x["output_throughput"], goal=f"out tok/s, p99 "
                         f"TTFT {x['p99_ttft_ms']:,.1f} ms, TPOT {x['p99_tpot_ms']:,.2f} ms, failed {x['failed']}"))
    errors = [f"{s}.{k}" for s, part in r.items() if isinstance(part, dict) for k in part if k.endswith("error")]
    lines.append(f"steps s: {r['sections_s']}; total {r.get('total_s')} s")
    lines.append(f"errors: {errors or 'none'}; skipped: {r['skipped'] or 'none'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="a,b,c,d")
    ap.add_argument("--cpu-smoke", "--smoke", action="store_true",
                    help="CPU, float32, a tiny random model and tiny workloads")
    ap.add_argument("--paging-shape", choices=("small", "8b"), default="small",
                    help="(c)'s model: the SmolLM2-135M shape (quick) or the Llama-3-8B shape")
    ap.add_argument("--paging-repeats", type=int, help="(c)'s timed runs per mix and backend (default 3)")
    ap.add_argument("--sweep-prompts", type=int, help="(d)'s requests per level (default 128)")
    ap.add_argument("--no-engine-process", action="store_true", help="serve with the engine loop on a thread of "
                    "the server's process (vserve serve --no-engine-process) instead of its own process")
    ap.add_argument("--budget-s", type=float, default=285.0, help="skip (b)'s caching-off run or (c) when too "
                    "little of this many seconds is left, so the run ends with its table inside the call's limit")
    args = ap.parse_args()
    plan = Plan.smoke() if args.cpu_smoke else Plan(LLAMA3_8B, SMOLLM2 if args.paging_shape == "small" else LLAMA3_8B)
    if args.cpu_smoke:  # one CPU thread per process: a busy small machine makes OpenMP threads wait on each other
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    plan.sweep_prompts = args.sweep_prompts or plan.sweep_prompts
    plan.paging_repeats = args.paging_repeats or plan.paging_repeats
    plan.engine_process = not args.no_engine_process
    sections = set(args.sections.split(","))
    rec = Recorder(Path(args.out), args.budget_s)
    rec.results["plan"] = {k: v for k, v in asdict(plan).items() if k not in ("model", "paging_model")}
    rec.results["model"] = {k: plan.model[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    t0 = time.perf_counter()
    folder = model_folder(plan.model)
    if sections & {"a", "d"}:
        run_server_phase(rec, plan, folder, sections)
    import torch  # CUDA starts in this process only now: the server had the GPU to itself

    rec.results["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
                          if torch.cuda.is_available() and not args.cpu_smoke else "cpu",
                          "gpu_free_fraction_after_server": wait_gpu_released()}
    if sections & {"a", "b"}:
        run_offline_phase(rec, plan, folder, sections)
    if "c" in sections and rec.enough_time("c.paging", 45 if args.paging_shape == "small" else 90):
        run_paging(rec, plan)
    rec.results["total_s"] = round(time.perf_counter() - t0, 1)
    rec.write()
    print("\n".join(summary(rec.results)))


if __name__ == "__main__":
    main()
