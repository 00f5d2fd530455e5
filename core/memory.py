"""Memory planner: weights, activations, CUDA graphs and runtime beside the KV cache -> KV blocks, the longest
sequence and the concurrency that fit. The engine sizes its cache with `plan_memory`; `vserve doctor` predicts
with the same function, so the two cannot disagree.

Every byte count is for one GPU (one tensor-parallel rank). Estimates that are not pure arithmetic (runtime,
CUDA graph pool) are named constants below; docs/doctor.md says how they were chosen.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from vserve.core.model_config import ModelConfig
from vserve.ops.model_shapes import mla_shape, moe_shape

GiB = 1 << 30
MiB = 1 << 20

# Outside torch's allocator, so not in torch.cuda.max_memory_allocated: the CUDA context, cuBLAS handles,
# Triton's loaded kernels, allocator slack. vLLM sees 0.5-1 GiB of such memory per GPU.
RUNTIME_OVERHEAD_BYTES = 768 * MiB
NCCL_OVERHEAD_BYTES = 512 * MiB  # per rank when TP > 1: communicators and their channel buffers
SAMPLER_BYTES_PER_LOGIT = 20  # float32 logits and probs, a sort's float32 values and int64 indices (top-k/p)
TIGHT_CONCURRENCY = 4  # fewer --max-model-len sequences than this fit at once: the verdict is "tight"


@dataclass(frozen=True)
class QuantSpec:
    """Weight-only storage of a quantization method: bits per weight plus per-group scales and zeros."""

    name: str
    bits: int
    group_size: int | None  # None: one scale per output channel
    zeros: bool  # asymmetric: a zero point per group, packed at `bits` (AWQ, GPTQ)
    scale_bytes: int = 2
    g_idx: bool = False  # GPTQ: an int32 group index per input channel
    act_order: bool = False  # GPTQ desc_act: row-parallel ranks keep every group (their inputs span all groups)
    weight_only: bool = False  # W4A16 / W8A16: batches dequantize each weight into one shared model-dtype buffer


QUANTIZATIONS = {
    "awq": QuantSpec("awq", 4, 128, True, weight_only=True),
    "gptq": QuantSpec("gptq", 4, 128, True, g_idx=True, weight_only=True),
    "fp8": QuantSpec("fp8", 8, None, False, 4),
    "int8": QuantSpec("int8", 8, None, False, 4),
}


def quant_spec(quantization) -> QuantSpec | None:
    """A method name, a QuantSpec, or a loaded checkpoint's QuantConfig (model.quant_config: its exact layout)."""
    if quantization is None or isinstance(quantization, QuantSpec):
        return quantization
    if hasattr(quantization, "memory_spec"):
        return quantization.memory_spec()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return QUANTIZATIONS[quantization]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    heads, kv = m.num_attention_heads, m.num_key_value_heads
    if tp < 1 or heads % tp:
        raise ValueError(f"--tensor-parallel-size must divide the model's {heads} attention heads, got {tp}")
    if kv % tp and tp % kv:
        raise ValueError(f"--tensor-parallel-size must divide or be a multiple of the model's {kv} KV heads, "
                         f"got {tp}")


def kv_heads_per_rank(m: ModelConfig, tp: int = 1) -> int:
    """KV heads are split over ranks; with fewer heads than ranks each rank holds a replica of one."""
    return max(1, m.num_key_value_heads // tp)


# Norm weights a layer has besides its q/k norms (Llama's 2: before attention and before the MLP), by architecture.
_NORMS_PER_LAYER = {"Gemma2ForCausalLM": 4, "Gemma3ForCausalLM": 4, "CohereForCausalLM": 1, "Cohere2ForCausalLM": 1}


def _gated(m: ModelConfig) -> bool:
    """gate_up + down (every family but StarCoder2's plain c_fc + c_proj)."""
    return m.architecture != "Starcoder2ForCausalLM"


def _linear_layers(m: ModelConfig, tp: int) -> list[tuple[int, int, int, bool]]:
    """(in_features, out_features, how many, row-parallel) of one rank's quantizable linear layers."""
    H, L = m.hidden_size, m.num_hidden_layers
    q = m.num_attention_heads // tp * m.head_dim
    kv = kv_heads_per_rank(m, tp) * m.head_dim
    mla = mla_shape(m)
    if mla is None:
        layers = [(H, q + 2 * kv, L, False), (q, H, L, True)]
    else:  # q_a_proj and kv_a_proj_with_mqa replicated; q_b_proj (q_proj), kv_b_proj and o_proj split by heads
        heads, r = m.num_attention_heads // tp, mla.kv_lora_rank
        qk = heads * (mla.nope_dim + mla.rope_dim)
        layers = [(H, mla.q_lora_rank, L, False), (mla.q_lora_rank, qk, L, False)] if mla.q_lora_rank else \
            [(H, qk, L, False)]
        layers += [(H, r + mla.rope_dim, L, False), (r, heads * (mla.nope_dim + mla.v_dim), L, False),
                   (heads * mla.v_dim, H, L, True)]
    moe = moe_shape(m)
    mlps = [(m.intermediate_size, L)] if moe is None else \
        [(moe.intermediate_size, (L - moe.dense_layers) * moe.num_experts), (m.intermediate_size, moe.dense_layers)]
    if moe is not None and moe.shared_intermediate_size:
        mlps.append((moe.shared_intermediate_size, L - moe.dense_layers))
    for inter, n in mlps:
        i = _cdiv(inter, tp)
        # gate_up (c_fc) column-parallel, down (c_proj) row-parallel
        layers += [(H, (2 if _gated(m) else 1) * i, n, False), (i, H, n, True)]
    return layers


def _other_params(m: ModelConfig, tp: int) -> int:
    """One rank's parameters that stay in the model dtype: embeddings, lm_head, norms, biases, the MoE router."""
    H, L, hd = m.hidden_size, m.num_hidden_layers, m.head_dim
    norm = 2 if m.architecture == "Starcoder2ForCausalLM" else 1  # LayerNorm with a bias
    n = _cdiv(m.vocab_size, tp) * H * (1 if m.tie_word_embeddings else 2) + \
        (_NORMS_PER_LAYER.get(m.architecture, 2) * L + 1) * H * norm
    if m.qk_norm:  # Command R+: weights per head; the others share one over the heads
        per_head = m.architecture.startswith("Cohere")
        n += (m.num_attention_heads // tp + kv_heads_per_rank(m, tp) if per_head else 2) * hd * L
    if m.attention_bias:
        n += (m.num_attention_heads // tp + 2 * kv_heads_per_rank(m, tp)) * hd * L
    if m.use_bias:  # StarCoder2: o_proj, c_fc and c_proj too
        n += (2 * H + _cdiv(m.intermediate_size, tp)) * L
    mla = mla_shape(m)
    if mla is not None:  # kv_a_layernorm, q_a_layernorm
        n += (mla.kv_lora_rank + (mla.q_lora_rank or 0)) * L
    moe = moe_shape(m)
    if moe is not None:
        sparse = L - moe.dense_layers
        if "n_routed_experts" in m.raw:  # DeepSeek: the router, V3's correction bias; no shared-expert gate
            n += (H + (1 if m.architecture == "DeepseekV3ForCausalLM" else 0)) * moe.num_experts * sparse
        else:
            n += H * moe.num_experts * sparse + (H * sparse if moe.shared_intermediate_size else 0)
    return n


def num_params(m: ModelConfig) -> int:
    """Parameters of the whole model (tensor-parallel size 1)."""
    return sum(i * o * n for i, o, n, _ in _linear_layers(m, 1)) + _other_params(m, 1)


def weights_bytes(m: ModelConfig, dtype_bytes: int, quantization: str | QuantSpec | None = None,
                  tensor_parallel_size: int = 1) -> int:
    """One rank's weights: linear layers at the quantization's bits plus its scales and zeros, the rest in dtype."""
    spec = quant_spec(quantization)
    total = _other_params(m, tensor_parallel_size) * dtype_bytes
    for fin, fout, n, row in _linear_layers(m, tensor_parallel_size):
        if spec is None:
            total += n * fin * fout * dtype_bytes
            continue
        grouped_in = fin * tensor_parallel_size if spec.act_order and row else fin
        groups = fout * (1 if spec.group_size is None else _cdiv(grouped_in, spec.group_size))
        meta = groups * spec.scale_bytes + (groups * spec.bits // 8 if spec.zeros else 0)
        total += n * (fin * fout * spec.bits // 8 + meta + (4 * fin if spec.g_idx else 0))
    return total


def kv_bytes_per_token(m: ModelConfig, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """2 (K and V) x layers x one rank's KV heads x head dim x dtype bytes; MLA (DeepSeek): layers x (kv_lora_rank
    + rope dim) x dtype bytes, the compressed latent, the same on every rank."""
    mla = mla_shape(m)
    if mla is not None:
        return m.num_hidden_layers * (mla.kv_lora_rank + mla.rope_dim) * dtype_bytes
    return 2 * m.num_hidden_layers * kv_heads_per_rank(m, tensor_parallel_size) * m.head_dim * dtype_bytes


def activation_bytes(m: ModelConfig, num_tokens: int, num_sampled: int, dtype_bytes: int,
                     tensor_parallel_size: int = 1) -> int:
    """Peak of one forward over num_tokens: the residual plus the larger of the attention and MLP temporaries
    (flash-style attention: no tokens x tokens scores), plus the sampler's float32 work on num_sampled rows."""
    tp = tensor_parallel_size
    H = m.hidden_size
    q = m.num_attention_heads // tp * m.head_dim
    kv = kv_heads_per_rank(m, tp) * m.head_dim
    attn = H + (q + 2 * kv) + q  # normed input, qkv, attention output
    mla = mla_shape(m)
    if mla is not None:  # normed input, q, latent + k_pe, q absorbed into the latent space, attention output
        heads, latent = m.num_attention_heads // tp, mla.kv_lora_rank + mla.rope_dim
        attn = H + heads * (mla.nope_dim + mla.rope_dim) + latent + heads * latent + heads * mla.v_dim
    moe = moe_shape(m)
    if moe is None:
        mlp = H + (3 if _gated(m) else 2) * _cdiv(m.intermediate_size, tp)  # normed input, gate_up, act(gate) * up
    else:
        mlp = H + moe.top_k * 3 * _cdiv(moe.intermediate_size, tp) + 4 * moe.num_experts // dtype_bytes
    hidden = num_tokens * (H + max(attn, mlp)) * dtype_bytes
    return hidden + num_sampled * m.vocab_size * (dtype_bytes + SAMPLER_BYTES_PER_LOGIT)


def dequant_buffer_bytes(m: ModelConfig, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """The buffer weight-only layers dequantize into for cuBLAS (kernels/triton_w4a16.py dequant_buffer): the
    largest linear weight of a rank, in the model dtype."""
    return max(i * o for i, o, _, _ in _linear_layers(m, tensor_parallel_size)) * dtype_bytes


def context_limit(m: ModelConfig) -> int:
    """The longest sequence the model serves (sliding-window models included: their window is per layer)."""
    return m.max_position_embeddings


@dataclass
class MemoryPlan:
    """Where one GPU's memory goes (bytes per rank), and what the KV cache left over holds."""

    device: str  # "cuda" or "cpu"
    gpu_memory_bytes: int | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    quantization: str | None
    dtype_bytes: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    runtime_bytes: int  # outside torch's allocator
    other_processes_bytes: int
    lora_bytes: int  # --max-loras adapter slots of --max-lora-rank on every adapted projection (0: LoRA off)
    in_use_bytes: int | None  # measured by the engine (weights, context, other processes); None: predicted
    budget_bytes: int  # GPU: total x utilization; CPU / fixed: the KV cache budget
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int
    kv_cache_bytes: int
    max_model_len_fit: int  # the longest sequence the cache holds, within the model's context
    max_concurrency: float  # --max-model-len sequences the cache holds at once
    kv_blocks_per_seq: int  # blocks one --max-model-len sequence holds at most (fewer where every layer slides)
    sliding_window: int | None  # the window the KV manager releases blocks behind (None: every block is kept)
    verdict: str  # fits | tight | oom
    reason: str
    prefix_cache_max_blocks: int | None = None  # --cache-size-gb: free blocks the prefix cache keeps (None: all)

    @property
    def non_kv_bytes(self) -> int:
        """What the GPU needs before any KV cache: weights, activations, CUDA graphs, runtime."""
        return (self.weights_bytes + self.activation_bytes + self.cuda_graph_bytes + self.runtime_bytes
                + self.lora_bytes)

    @property
    def torch_peak_bytes(self) -> int:
        """What torch.cuda.max_memory_allocated should read after a full-batch run (runtime excluded)."""
        return (self.weights_bytes + self.activation_bytes + self.cuda_graph_bytes + self.kv_cache_bytes
                + self.lora_bytes)

    @property
    def total_bytes(self) -> int:
        return self.non_kv_bytes + self.kv_cache_bytes

    @property
    def fits(self) -> bool:
        return self.verdict != "oom"

    def check(self) -> None:
        """Raise the ValueError a person reads when the plan does not fit."""
        if self.verdict != "oom":
            return
        if self.device == "cpu" or self.reason.startswith("the KV cache holds"):
            check_fits_one_sequence(self.num_blocks, self.block_size, self.kv_blocks_per_seq * self.block_size,
                                    self.kv_bytes_per_block)
        raise ValueError(self.reason)

    def as_dict(self) -> dict:
        return {**asdict(self), "non_kv_bytes": self.non_kv_bytes, "torch_peak_bytes": self.torch_peak_bytes,
                "total_bytes": self.total_bytes}


def plan_memory(model: ModelConfig, *, gpu_memory_bytes: int | None, gpu_memory_utilization: float = 0.9,
                dtype_bytes: int = 2, quantization: str | QuantSpec | None = None, tensor_parallel_size: int = 1,
                block_size: int = 16, max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                max_num_seqs: int = 256, cuda_graphs: bool = True, kv_dtype_bytes: int | None = None,
                kv_cache_bytes: int | None = None, num_kv_blocks: int | None = None,
                other_processes_bytes: int = 0, in_use_bytes: int | None = None,
                peak_activation_bytes: int | None = None, sliding_window: int | None = None,
                max_loras: int = 0, max_lora_rank: int = 16,
                prefix_cache_bytes: int | None = None) -> MemoryPlan:
    """Plan one rank's memory.

    gpu_memory_bytes None plans the CPU path: the KV cache gets kv_cache_bytes (default: default_cpu_kv_budget()).
    On a GPU the cache gets what gpu_memory_bytes x gpu_memory_utilization leaves after weights, runtime, other
    processes, the activation peak and the CUDA graph pool, or exactly kv_cache_bytes when given. A fixed
    budget is capped at what max_num_seqs full-length sequences can use; num_kv_blocks forces the count.
    An engine that has loaded the weights passes what it measured: in_use_bytes (total - free: weights,
    CUDA context, other processes) replaces the predicted weights + runtime + other processes, and
    peak_activation_bytes the predicted activation peak. sliding_window (ModelConfig.kv_window(), for an engine
    whose KV manager releases the blocks behind it): a sequence holds at most its window's blocks plus a step's
    tokens (kv_blocks_per_seq), however long it grows. max_loras (0: LoRA off) adapter slots of max_lora_rank
    are held on every adapted projection (lora_slot_bytes). prefix_cache_bytes (--cache-size-gb): the free blocks
    the prefix cache may keep cached (prefix_cache_max_blocks).
    """
    tp = tensor_parallel_size
    check_tensor_parallel(model, tp)
    spec = quant_spec(quantization)
    on_gpu = gpu_memory_bytes is not None
    max_len = max_model_len or context_limit(model)
    per_token = kv_bytes_per_token(model, kv_dtype_bytes or dtype_bytes, tp)
    per_block = per_token * block_size
    seq_blocks = kv_blocks_per_seq(max_len, block_size, sliding_window, max_num_batched_tokens)
    seq_tokens = max_len if sliding_window is None else seq_blocks * block_size  # what one sequence holds
    weights = weights_bytes(model, dtype_bytes, spec, tp)
    if peak_activation_bytes is not None:  # measured: the profile pass makes the dequantize buffer too
        activations = peak_activation_bytes
    else:
        activations = activation_bytes(model, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens),
                                       dtype_bytes, tp)
        if spec is not None and spec.weight_only:
            activations += dequant_buffer_bytes(model, dtype_bytes, tp)
    graphs = GRAPH_POOL_RESERVE if on_gpu and cuda_graphs else 0
    runtime = RUNTIME_OVERHEAD_BYTES + (NCCL_OVERHEAD_BYTES if tp > 1 else 0) if on_gpu else 0
    in_use = in_use_bytes if in_use_bytes is not None else weights + runtime + other_processes_bytes
    lora = lora_slot_bytes(model, max_loras, max_lora_rank, dtype_bytes, tp)
    reserved = in_use + activations + graphs + lora  # what the GPU holds besides the KV cache

    fixed = (kv_cache_bytes if kv_cache_bytes is not None else
             None if on_gpu else default_cpu_kv_budget(seq_blocks * per_block))
    budget = int(gpu_memory_bytes * gpu_memory_utilization) if on_gpu else fixed
    if num_kv_blocks is not None:
        num_blocks = num_kv_blocks
    elif fixed is not None:
        num_blocks = min(int(fixed // per_block), max_num_seqs * seq_blocks)
    else:
        num_blocks = max(0, (budget - reserved) // per_block)
    kv_cache = num_blocks * per_block

    verdict, reason = "fits", ""
    sized = fixed is None and num_kv_blocks is None  # the cache takes what the utilization leaves
    need, room = (reserved, budget) if sized else (reserved + kv_cache, gpu_memory_bytes)
    if on_gpu and need > room:
        parts = (f"weights {fmt_bytes(weights)}, runtime {fmt_bytes(runtime)}" if in_use_bytes is None
                 else f"in use {fmt_bytes(in_use)}")
        verdict = "oom"
        reason = (f"{'the model needs' if sized else 'the model and its KV cache need'} {fmt_bytes(need)} per GPU "
                  f"({parts}, activations {fmt_bytes(activations)}, CUDA graphs {fmt_bytes(graphs)}"
                  f"{f', LoRA slots {fmt_bytes(lora)}' if lora else ''}"
                  f"{f', other processes {fmt_bytes(other_processes_bytes)}' if other_processes_bytes else ''}) "
                  f"but {fmt_bytes(room)} is available"
                  f"{f' ({gpu_memory_utilization} x {fmt_bytes(gpu_memory_bytes)})' if sized else ''}")
    elif num_blocks < seq_blocks:
        verdict = "oom"
        reason = (f"the KV cache holds {num_blocks * block_size} tokens but one --max-model-len {max_len} "
                  f"sequence needs {seq_blocks * block_size}")
    elif num_blocks * block_size < min(TIGHT_CONCURRENCY, max_num_seqs) * seq_tokens:
        verdict = "tight"
        reason = (f"only {num_blocks * block_size / seq_tokens:.1f} sequences of --max-model-len {max_len} fit in "
                  f"the KV cache at once")
    return MemoryPlan(
        device="cuda" if on_gpu else "cpu", gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tp,
        quantization=spec.name if spec else None, dtype_bytes=dtype_bytes, block_size=block_size,
        max_model_len=max_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        weights_bytes=weights, activation_bytes=activations, cuda_graph_bytes=graphs, runtime_bytes=runtime,
        other_processes_bytes=other_processes_bytes, lora_bytes=lora, in_use_bytes=in_use_bytes, budget_bytes=budget,
        kv_bytes_per_token=per_token, kv_bytes_per_block=per_block, num_blocks=num_blocks, kv_cache_bytes=kv_cache,
        max_model_len_fit=(min(num_blocks * block_size, context_limit(model)) if sliding_window is None else
                           context_limit(model) if num_blocks >= seq_blocks else 0),
        max_concurrency=num_blocks * block_size / seq_tokens, kv_blocks_per_seq=seq_blocks,
        sliding_window=sliding_window, verdict=verdict, reason=reason,
        prefix_cache_max_blocks=(None if prefix_cache_bytes is None else
                                 min(num_blocks, prefix_cache_bytes // per_block)))


# ---- helpers plan_memory is built on -------------------------------------------------------------------------


def lora_slot_bytes(m: ModelConfig, max_loras: int, max_lora_rank: int, dtype_bytes: int, tp: int = 1) -> int:
    """One rank's LoRA slots (core/lora/layers.py): per slot and layer, A [slices x R, in] and B [out, R] of qkv,
    o, gate_up and down (R: the rank, at least 16), sharded as their base layers (column-parallel: B's rows;
    row-parallel: A's input columns)."""
    if not max_loras:
        return 0
    R, H, L = max(16, max_lora_rank), m.hidden_size, m.num_hidden_layers
    q = m.num_attention_heads // tp * m.head_dim
    kv = kv_heads_per_rank(m, tp) * m.head_dim
    per_layer = (3 * R * H + (q + 2 * kv) * R) + (R * q + H * R)  # qkv, o
    if moe_shape(m) is None and _gated(m):
        i = _cdiv(m.intermediate_size, tp)
        per_layer += (2 * R * H + 2 * i * R) + (R * i + H * R)  # gate_up, down
    return max_loras * L * per_layer * dtype_bytes


def kv_blocks_per_seq(max_model_len: int, block_size: int, sliding_window: int | None = None,
                      max_num_batched_tokens: int | None = None) -> int:
    """KV blocks one sequence of max_model_len tokens holds at most. Behind a sliding window (every layer slides,
    the blocks before the window released): the window's blocks, one more where it straddles a block boundary,
    and one step's new tokens (vLLM's SlidingWindowSpec.max_memory_usage_bytes)."""
    full = _cdiv(max_model_len, block_size)
    if sliding_window is None:
        return full
    step = min(max_num_batched_tokens or max_model_len, max_model_len)
    return min(full, _cdiv(sliding_window - 1, block_size) + 1 + _cdiv(step, block_size))


def cpu_available_bytes() -> int:
    """Memory a new allocation can take without swapping: MemAvailable (free pages plus the page cache and
    slabs the kernel can reclaim), not the free pages alone, which a machine that has read many files (a CI
    runner half way through a test suite) holds few of."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 16 * GiB


def default_cpu_kv_budget(one_sequence_bytes: int = 0) -> int:
    """1 GiB (tens of thousands of tokens for small models), or a quarter of the available memory if less; at
    least one_sequence_bytes (one --max-model-len sequence) where half the available memory holds it."""
    avail = cpu_available_bytes()
    budget = min(GiB, avail // 4)
    return max(budget, one_sequence_bytes) if one_sequence_bytes <= avail // 2 else budget


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def check_fits_one_sequence(num_blocks: int, block_size: int, max_model_len: int, per_block: int) -> None:
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens, "
            f"{fmt_bytes(num_blocks * per_block)}) but one --max-model-len {max_model_len} sequence needs "
            f"{need} blocks ({fmt_bytes(need * per_block)}); lower --max-model-len or give the cache more memory"
        )


GRAPH_POOL_RESERVE = 512 * MiB  # decode CUDA graphs' pool, held back when graphs are captured
