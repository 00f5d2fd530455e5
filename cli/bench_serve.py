"""`vserve bench serve`: stream requests to any OpenAI-compatible server and measure TTFT, TPOT, ITL, E2EL."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.progress import ProgressColumn
from rich.table import Table
from rich.text import Text

from vserve.cli.bench_datasets import DATASETS, Workload, make_workload, parse_len
from vserve.cli.bench_metrics import METRICS, RequestFuncOutput, parse_goodput, summarize
from vserve.cli.engine_args import exit_on_bad_input, fail
from vserve.ops.progress import make_progress  # rich only, no torch

if TYPE_CHECKING:
    import aiohttp  # imported where used: 0.17 s of every `vserve` command's start

console = Console(highlight=False)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
Prompt = str | list[int]  # text, or token ids with --token-ids (completions only)


class TokRateColumn(ProgressColumn):
    """Live streamed tokens per second (one token per streamed chunk), re-read at every refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.t0 = 0, time.perf_counter()

    def render(self, task) -> Text:
        return Text(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s")


@dataclass
class ServeConfig:
    """Where and how requests are sent; the same for every concurrency level of a sweep."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_rate: float = float("inf")
    ignore_eos: bool = True
    temperature: float = 1.0
    seed: int = 0
    timeout_s: float = 600.0


def _payload(cfg: ServeConfig, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and vserve's extension: exactly max_tokens tokens
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {message}"


def _sse_events(buffer: bytearray) -> list[str]:
    """Take the complete `data:` lines out of `buffer` (bytes read so far), leaving a partial line in it."""
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    return [line[5:].strip().decode() for line in lines if line.startswith(b"data:")]


async def send_request(session: aiohttp.ClientSession, cfg: ServeConfig, prompt: Prompt, prompt_len: int,
                       max_tokens: int, t0: float, on_chunk=None) -> RequestFuncOutput:
    """One streamed request; never raises (a failure is recorded in `error`)."""
    out = RequestFuncOutput(prompt_len=prompt_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sent = time.perf_counter()
    out.start = sent - t0
    chunks, usage, done = 0, None, False
    try:
        async with session.post(cfg.base_url + ENDPOINTS[cfg.endpoint], json=_payload(cfg, prompt, max_tokens),
                                headers=headers) as resp:
            if resp.status != 200:
                out.error = _error_message(resp.status, await resp.read())
                return out
            last, buffer = sent, bytearray()
            async for data in resp.content.iter_any():
                buffer += data
                for event in _sse_events(buffer):
                    if event == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(event)
                    if "error" in chunk:  # an error after the 200 (vserve validates streamed requests there)
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                        out.error = f"stream error {err.get('code') or ''}: {err.get('message')}"
                        return out
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    text = choices[0].get("text") if cfg.endpoint == "completions" else \
                        (choices[0].get("delta") or {}).get("content")
                    if not text:  # role-only or finish-only chunk, or text held back
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - sent
                    else:
                        out.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    if on_chunk is not None:
                        on_chunk()
                if done:
                    break
        out.latency = time.perf_counter() - sent
    except Exception as e:  # a failed request is a data point, never the end of the run
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    if chunks == 0:
        out.error = "no tokens streamed"
        return out
    # The server's count when it reports usage (a chunk can hold several tokens), else one per chunk.
    out.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    if usage and usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])
    out.success = True
    return out


def _session(cfg: ServeConfig, max_connections: int) -> aiohttp.ClientSession:
    """aiohttp, as vLLM's benchmark client: its C HTTP parser keeps the client from being what is measured (with
    httpx, opening 256 connections at once took the client ~0.6 s and streaming cost ~2x the CPU per chunk)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                 connector=aiohttp.TCPConnector(limit=max_connections, force_close=False))


async def run_benchmark(cfg: ServeConfig, prompts: list[Prompt], prompt_lens: list[int], output_lens: list[int],
                        max_concurrency: int | None, label: str = "") -> tuple[list[RequestFuncOutput], float]:
    """Send every request (Poisson arrivals at request_rate, at most max_concurrency in flight)."""
    rng = random.Random(cfg.seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rate = TokRateColumn()

    def on_chunk() -> None:
        rate.tokens += 1

    with make_progress(rate) as progress:
        task = progress.add_task(f"bench serve{label}", total=len(prompts))
        async with _session(cfg, max_concurrency or len(prompts)) as session:
            t0 = rate.t0 = time.perf_counter()

            async def one(i: int) -> RequestFuncOutput:
                if sem is None:
                    o = await send_request(session, cfg, prompts[i], prompt_lens[i], output_lens[i], t0, on_chunk)
                else:
                    async with sem:
                        o = await send_request(session, cfg, prompts[i], prompt_lens[i], output_lens[i], t0,
                                               on_chunk)
                progress.advance(task)
                return o

            tasks = []
            for i in range(len(prompts)):
                tasks.append(asyncio.create_task(one(i)))
                if cfg.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(cfg.request_rate))
            outputs = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - t0
    return outputs, duration


async def warm_up(cfg: ServeConfig, prompts: list[Prompt], output_lens: list[int], n: int) -> None:
    """n untimed requests, one at a time (first-request costs stay out of the numbers); failures ignored."""
    async with _session(cfg, 1) as session:
        for i in range(n):
            j = i % len(prompts)
            # Reversed text: as long as a real prompt, but no prefix the prefix cache could serve it from.
            await send_request(session, cfg, prompts[j][::-1], 0, min(output_lens[j], 16), time.perf_counter())


async def _get_models(base_url: str, headers: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url + "/v1/models", headers=headers) as resp:
            return resp.status, (await resp.json(content_type=None) if resp.status == 200 else {})


def resolve_model(base_url: str, api_key: str | None) -> str:
    """The first id of GET /v1/models (the served model when --model is not given)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, body = asyncio.run(_get_models(base_url, headers))
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise ValueError(f"cannot reach --base-url {base_url!r}: {e}") from None
    if status != 200 or not body.get("data"):
        raise ValueError(f"GET {base_url}/v1/models answered {status}; pass --model NAME")
    return body["data"][0]["id"]


def load_tokenizer(path: str | None):
    """A `tokenizers.Tokenizer` (no torch): --tokenizer's tokenizer.json, else the embedded default model's."""
    import tokenizers

    if path is None:
        from vserve.ops.assets import default_model_path

        folder = default_model_path()
    else:
        folder = Path(path)
    file = folder / "tokenizer.json" if folder.is_dir() else folder
    if not file.is_file():
        raise ValueError(f"--tokenizer {str(folder)!r} has no tokenizer.json")
    return tokenizers.Tokenizer.from_file(str(file))


def build_prompts(w: Workload, tok) -> tuple[list[str], list[int]]:
    """Text to send: a file's prompts as written, token-id workloads decoded; lengths re-measured on the text."""
    texts = w.texts or tok.decode_batch(w.prompts, skip_special_tokens=False)
    lens = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    return texts, lens


RUN_ROWS = (("completed", "completed", "{:,}"), ("failed", "failed", "{:,}"), ("duration s", "duration_s", "{:.2f}"),
            ("input tokens", "total_input_tokens", "{:,}"), ("output tokens", "total_output_tokens", "{:,}"),
            ("requests/s", "request_throughput", "{:.2f}"), ("output tok/s", "output_throughput", "{:,.1f}"),
            ("total tok/s", "total_token_throughput", "{:,.1f}"))


def render(runs: list[dict[str, Any]]) -> None:
    """One column per concurrency level; throughput rows, then each latency metric's statistics in ms."""
    table = Table(title="Online serving", title_justify="left")
    table.add_column("")
    for r in runs:
        table.add_column(f"conc {r['max_concurrency'] or 'inf'}", justify="right")
    for label, key, fmt in RUN_ROWS:
        table.add_row(label, *(fmt.format(r[key]) for r in runs))
    if runs[0]["goodput"] is not None:
        table.add_row("goodput req/s", *(f"{r['goodput']:.2f}" for r in runs))
    for metric in METRICS:
        table.add_section()
        for stat in ("mean", "median", "std", "p90", "p99"):
            table.add_row(f"{metric.upper()} {stat} ms", *(f"{r[f'{stat}_{metric}_ms']:,.2f}" for r in runs))
    console.print(table)
    for r in runs:
        common = sorted(r["errors"].items(), key=lambda kv: -kv[1])
        for err, n in common[:5]:
            console.print(f"conc {r['max_concurrency'] or 'inf'}: {n} failed: {err}", style="red", markup=False)
        if len(common) > 5:
            console.print(f"conc {r['max_concurrency'] or 'inf'}: {sum(n for _, n in common[5:])} failed with "
                          f"{len(common) - 5} other messages (--save-result keeps every one)", style="red")


def parse_sweep(value: str | None) -> list[int | None]:
    if not value:
        return []
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--sweep-concurrency takes comma-separated integers >= 1, got {value!r}")
    return levels


def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="Server root (the /v1 routes are appended)."),
    model: str = typer.Option(None, help="Model id to send (default: the first of GET /v1/models)."),
    api_key: str = typer.Option(None, help="Bearer token (default: $OPENAI_API_KEY, then $VSERVE_API_KEY)."),
    endpoint: str = typer.Option("completions", help="completions (/v1/completions) or chat (/v1/chat/completions)."),
    num_prompts: int = typer.Option(100, help="Number of requests."),
    request_rate: float = typer.Option(float("inf"), help="Requests per second, Poisson arrivals; inf: all at once."),
    max_concurrency: int = typer.Option(None, help="Most requests in flight (default: unlimited)."),
    sweep_concurrency: str = typer.Option(None, help="Comma-separated levels, e.g. 1,8,32: one run at each."),
    dataset: str = typer.Option("random", help=f"{' | '.join(DATASETS)}."),
    dataset_path: str = typer.Option(None, help="Prompts file for --dataset file (.txt or .jsonl)."),
    input_len: str = typer.Option("128", help="Prompt (random) or suffix (prefix) length: N or A:B."),
    output_len: str = typer.Option("128", help="Output length in tokens: N or A:B."),
    prefix_len: int = typer.Option(256, help="Shared prefix length for --dataset prefix."),
    num_prefixes: int = typer.Option(1, help="Distinct prefixes for --dataset prefix."),
    tokenizer: str = typer.Option(None, help="Tokenizer folder for building prompts (default: the embedded model's)."),
    seed: int = typer.Option(0, help="Workload and arrival-time seed."),
    temperature: float = typer.Option(1.0, help="Sampling temperature sent with every request."),
    num_warmups: int = typer.Option(1, help="Untimed requests sent one at a time before each run."),
    token_ids: bool = typer.Option(False, "--token-ids", help="Send token-id prompts (completions; vLLM and "
                                   "vserve accept them): exactly the offline workload, no re-tokenizing."),
    ignore_eos: bool = typer.Option(True, help="Send ignore_eos so every request yields exactly its output length."),
    goodput: list[str] = typer.Option(None, help="SLOs, e.g. 'ttft:500 tpot:50 e2el:2000' (ms)."),
    save_result: Path = typer.Option(None, help="Write the config, summaries and per-request data as JSON."),
    plot: Path = typer.Option(None, help="Write PNG charts into this folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    """Benchmark any OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput, goodput, failures."""
    with exit_on_bad_input():
        if endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be completions or chat, got {endpoint!r}")
        if token_ids and endpoint != "completions":
            raise ValueError("--token-ids needs --endpoint completions (chat messages are text)")
        if request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
        if num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {num_warmups}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        levels = parse_sweep(sweep_concurrency) or [max_concurrency]
        slos = parse_goodput(goodput or [])
        in_len, out_len = parse_len("--input-len", input_len), parse_len("--output-len", output_len)
        base_url = base_url.rstrip("/").removesuffix("/v1")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VSERVE_API_KEY")
        tok = load_tokenizer(tokenizer)
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        def workload(k: int) -> Workload:
            # Level k of a sweep gets seed + k: the same lengths' distribution, but prompts the server's
            # prefix cache has not seen in an earlier level (a prompts file is the same text every level).
            return make_workload(dataset, seed=seed + k, num_prompts=num_prompts, input_len=in_len,
                                 output_len=out_len, vocab_size=tok.get_vocab_size(), special_ids=special,
                                 encode=lambda s: tok.encode(s, add_special_tokens=False).ids,
                                 dataset_path=dataset_path, prefix_len=prefix_len, num_prefixes=num_prefixes)

        workloads = [workload(k) for k in range(len(levels))]  # bad dataset flags fail before any request
        model = model or resolve_model(base_url, api_key)
    cfg = ServeConfig(base_url, model, endpoint, api_key, request_rate, ignore_eos, temperature, seed)
    runs, per_request = [], []
    for level, w in zip(levels, workloads):
        texts, lens = (w.prompts, [len(p) for p in w.prompts]) if token_ids else build_prompts(w, tok)
        label = f" (concurrency {level})" if len(levels) > 1 else ""
        if num_warmups:
            asyncio.run(warm_up(cfg, texts, w.output_lens, num_warmups))
        outputs, duration = asyncio.run(run_benchmark(cfg, texts, lens, w.output_lens, level, label))
        runs.append({"max_concurrency": level, **summarize(outputs, duration, slos)})
        per_request.append(outputs)
    config = {**asdict(cfg), "api_key": None, "dataset": dataset, "num_prompts": num_prompts,
              "num_warmups": num_warmups, "input_len": list(in_len), "output_len": list(out_len),
              "goodput_slos_ms": slos}
    if config["request_rate"] == float("inf"):
        config["request_rate"] = "inf"  # JSON has no infinity
    if save_result is not None:
        detail = [{**r, "requests": [asdict(o) for o in outs]} for r, outs in zip(runs, per_request)]
        save_result.write_text(json.dumps({"config": config, "runs": detail}, indent=1))
    if plot is not None:
        try:
            from vserve.cli.bench_plot import plot_serve
        except ImportError:
            fail("--plot needs matplotlib (pip install matplotlib)")
        plot_serve(plot, runs, per_request)
    if as_json:
        typer.echo(json.dumps({"config": config, "runs": runs}))
    else:
        render(runs)
