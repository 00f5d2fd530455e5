"""What the end-to-end benchmarks share: the model shapes they run (random weights: --load-format dummy), a model
folder per shape with a synthetic tokenizer (no real one exists offline on the device machines, and users run with a
tokenizer), the CLI in a fresh process, and a `vserve serve` process."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
SMOLLM2 = dict(LLAMA3_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)
QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")
MIXTRAL_8X7B = dict(LLAMA3_8B, architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
                    max_position_embeddings=32768, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
                    bos_token_id=1, eos_token_id=2)
# Mixtral-8x7B's layers, 16 of its 32 (~47 GB in bf16): the shape an 80 GB H100 holds with a KV cache
MIXTRAL_8X7B_16L = dict(MIXTRAL_8X7B, num_hidden_layers=16)
# issue #26's MoE and MLA shapes: DeepSeek-V2-Lite (MLA with a 512 + 64 latent cache, 64 routed experts top-6 + 2
# shared, the first layer dense, yarn RoPE); Mixtral-8x7B is above
DEEPSEEK_V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
                        hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                        num_key_value_heads=16, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
                        routed_scaling_factor=1.0, norm_topk_prob=False, hidden_act="silu",
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
                        tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16")
# issue #25's shapes (docs/models.md): Gemma-2-9B (head_dim 256, softcaps, alternate sliding layers) and
# Phi-3-mini-128k (fused checkpoint tensors, LongRoPE: short factors below 4,096 positions, long factors above)
GEMMA2_9B = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
                 intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                 sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                 bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16")
# Gemma-2-2B: the float32 correctness check's Gemma-2 (the 9B in float32 twice, HF beside vserve, exceeds an 80 GB card)
GEMMA2_2B = dict(GEMMA2_9B, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                 num_key_value_heads=4)
PHI3_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
                 intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                 rope_theta=10000.0, sliding_window=262144, hidden_act="silu", tie_word_embeddings=False,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(48)],
                               "long_factor": [1.0 + 0.5 * i for i in range(48)]},
                 bos_token_id=1, eos_token_id=32000, pad_token_id=32000, torch_dtype="bfloat16")
# The 8B body with SmolLM2's 49,152-token vocabulary and its real tokenizer (VSERVE_BENCH_TOKENIZER: a folder with its
# tokenizer.json): the structured-output rows need a tokenizer that can spell JSON, which the synthetic one cannot
LLAMA3_8B_SV = dict(LLAMA3_8B, vocab_size=49152, bos_token_id=1, eos_token_id=2)
# --cpu-smoke's stand-in for every shape: the Llama layout, small enough for a CPU in float32 (hidden 128: the 4-bit
# layouts need K a multiple of their 128-wide groups)
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=510,
            eos_token_id=511, torch_dtype="float32")
# their --cpu-smoke stand-ins: the same structure at TINY's size (4 experts top-2; MLA latent 32 + rope 16)
TINY_MIXTRAL = dict(TINY, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2)
TINY_DEEPSEEK_V2 = dict(DEEPSEEK_V2_LITE, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=64, bos_token_id=510, eos_token_id=511,
                        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
                        torch_dtype="float32")
CLI = [sys.executable, "-m", "vserve.cli.main"]
os.environ.setdefault("VSERVE_NO_PROGRESS", "1")  # progress bars off here and in every process started (inherited)


def special_tokens(cfg: dict) -> dict[int, str]:
    """bos and eos by the config's ids; Llama-3's reserved ids 128000.. too for its vocabulary."""
    reserved = range(128000, 128256) if cfg["vocab_size"] == 128256 else range(0)
    names = {i: f"<|reserved_special_token_{i - reserved.start}|>" for i in reserved}
    return {**names, cfg["bos_token_id"]: "<|begin_of_text|>", cfg["eos_token_id"]: "<|end_of_text|>"}


def write_tokenizer(folder: Path, cfg: dict) -> None:
    """A word-level tokenizer over the whole vocabulary: token i decodes to `t{i}`, words joined by spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special_tokens(cfg)
    vocab = {special.get(i, f"t{i}"): i for i in range(cfg["vocab_size"])}
    eos = special[cfg["eos_token_id"]]
    tok = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(special[i], special=True) for i in sorted(special)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[cfg["bos_token_id"]],
                            eos_token=eos).save_pretrained(folder)


def model_folder(cfg: dict, tokenizer_dir: str | None = None) -> str:
    """A temporary model folder: config.json (cfg) and the synthetic tokenizer, or a real tokenizer's files copied
    from tokenizer_dir (its vocabulary must be cfg's)."""
    d = Path(tempfile.mkdtemp(prefix="vserve-bench-"))
    (d / "config.json").write_text(json.dumps(cfg))
    if tokenizer_dir is None:
        write_tokenizer(d, cfg)
    else:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(f, d / f.name)
    return str(d)


def workload(n: int, seed: int, vocab: int, out_len: tuple[int, int], in_len=(100, 1024)):
    """n prompts of random token ids (lengths U[in_len]) and their output lengths (U[out_len])."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(*in_len))] for _ in range(n)]
    return prompts, [rng.randint(*out_len) for _ in range(n)]


def start_decoding(core, vocab: int, penalty_fraction: float, prompt_lens: tuple[int, int], max_tokens: int,
                   eos_token_id: int | None = None, n: int = 256) -> None:
    """The host profiles' workload on an in-process EngineCore (engine_host_profile.py, host_phases.py): n requests
    of random token ids (prompts U[prompt_lens]) at temperature 1, eos ignored, the first penalty_fraction of them
    with repetition_penalty 1.1 and logprobs 5; stepped until every request decodes, then 20 steps more."""
    from vserve.core.request import Request
    from vserve.core.sampling_params import SamplingParams

    rng = random.Random(0)
    for i in range(n):
        extra = dict(repetition_penalty=1.1, logprobs=5) if i < penalty_fraction * n else {}
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **extra)
        prompt = [rng.randrange(10, vocab - 10) for _ in range(rng.randint(*prompt_lens))]
        core.add_request(Request(f"r{i}", prompt, sp, sp.max_tokens, eos_token_id=eos_token_id))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(20):
        core.step()


def hf_config(cfg: dict):
    """cfg as a transformers config (for HF peers on the same random weights)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                      if k not in ("architectures", "model_type", "torch_dtype")})


def free_gpu() -> None:
    """Collect what the last engine left and give its memory back, so that the next one's planner sees it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cli_json(args: list[str], timeout: float) -> dict:
    """`vserve ARGS --json` in a fresh process: its JSON object with the call's wall seconds, or its error."""
    start = time.monotonic()
    r = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stdout + r.stderr)[-3000:], "returncode": r.returncode}
    return {**json.loads(lines[-1]), "wall_s": time.monotonic() - start}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: list[str], log: Path, start_s: float):
    """`vserve serve ARGS --host 127.0.0.1 --port P`, up once /health answers: (url, pid); stopped (SIGTERM) on exit."""
    import httpx

    from vserve.cli.bench_startup import stop_process

    port = free_port()
    with log.open("w") as fh:
        proc = subprocess.Popen([*CLI, "serve", *args, "--host", "127.0.0.1", "--port", str(port)], stdout=fh,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not up in {start_s:.0f} s: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url, proc.pid
    finally:
        stop_process(proc)
