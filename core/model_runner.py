"""Model runner: owns the KV cache tensors, flattens a scheduled step into tensors, runs the model, samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vserve.core.distributed import broadcast_step, get_pp_rank, get_pp_size, get_rank, get_tp_size, isend, recv
from vserve.core.layers.attention import AttentionMetadata
from vserve.core.layers.rotary import longrope_offset
from vserve.core.model_config import ModelConfig
from vserve.core.prompt_logprobs import PromptLogprobsPlan, keep, plan_step, score
from vserve.core.request import Request
from vserve.core.sampler import SampledTokens, Sampler, SamplerOutput, same_requests
from vserve.core.scheduler import SchedulerOutput
from vserve.ops import startup


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond (at most 512)."""
    top = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b <= top]
    sizes += list(range(16, min(top, 64) + 1, 8)) + list(range(80, top + 1, 16))
    if sizes[-1] < top:
        sizes.append(top)
    return sizes


@dataclass
class StepInputs:
    """One step's inputs as CPU tensors: what rank 0 broadcasts to the other TP ranks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_decodes: int
    cu_seqlens_q: torch.Tensor
    sample_rows: torch.Tensor
    # Async scheduling: rows whose input token was sampled by the step before and is still on the device, and
    # where it sits in that step's sampled tokens (filled in on the device, see run_step). pending_all: every row's,
    # in the order that step sampled them (a steady decode batch): its sampled tokens are the input ids as they are.
    pending_rows: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None
    pending_all: bool = False
    # LoRA: each token's adapter slot (-1: none; None: no row has one) and adapters to load into slots first
    lora_slots: torch.Tensor | None = None
    lora_loads: list | None = None
    prompt_lp: PromptLogprobsPlan | None = None  # rows that score a prompt token (SamplingParams.prompt_logprobs)


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: auto keeps the model's dtype; fp8 / fp8_e4m3 store float8 e4m3fn (on CUDA, GPUs of
    compute capability >= 8.9, where Triton converts e4m3)."""
    if not kv_cache_dtype.startswith("fp8"):
        return dtype
    if device.type == "cuda" and (cap := torch.cuda.get_device_capability(device)) < (8, 9):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} needs a GPU of compute capability >= 8.9 (Ada, Hopper "
                         f"or newer); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use "
                         f"--kv-cache-dtype auto")
    return torch.float8_e4m3fn


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0, max_num_seqs: int = 256,
                 max_model_len: int = 4096, enforce_eager: bool = True, kv_cache_dtype: str = "auto",
                 lora=None) -> None:
        self.model = model
        self.lora = lora  # the model's LoRAModel (core/lora/layers.py) when LoRA is on
        self.lora_slots = None  # rank 0's LoRASlots (core/lora/manager.py), set by the engine
        self.cfg = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype, device)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.longrope = longrope_offset(model_config.rope_scaling, model_config.max_position_embeddings)
        with startup.phase("kv cache"):
            self.bind_kv_cache(num_blocks)
        self.sampler = Sampler(seed)
        self.pin = device.type == "cuda"
        self._staging: list[torch.Tensor | None] = [None, None]  # pinned host buffers for to_device, in turn
        self._turn = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self.last_tokens: torch.Tensor | None = None  # the last launched step's sampled tokens (on the device)
        self.last_reqs: list[Request] = []  # the requests they were sampled for, a row each
        self.prompt_scores: tuple[torch.Tensor, ...] | None = None  # the last step's prompt logprobs (device)
        self.prompt_segments: list = []  # [(request, first position, count)] of those scores
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if device.type == "cuda":  # every launch the 4-bit dispatch table names, compiled before the first request
            from vserve.core.layers.quantization import warm_up_w4a16

            with startup.phase("w4a16 kernels"):
                warm_up_w4a16(model, dtype, device)
        # MLA's attention (torch references, host syncs) runs eagerly: the model says so (cuda_graphs = False)
        if device.type == "cuda" and not enforce_eager and getattr(model, "cuda_graphs", True):
            with startup.phase("cuda graphs"):
                self.capture_graphs(graph_batch_sizes(max_num_seqs))
        if device.type == "cuda":  # the sampling kernels' variants, compiled before the first request (not in a step)
            from vserve.kernels.triton_sampling import warm_up as warm_up_sampling

            with startup.phase("sampling kernels"):
                warm_up_sampling(model_config.vocab_size, device)

    def bind_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)  # this TP rank's KV heads
            attn.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.empty(0, dtype=self.kv_dtype, device=self.device) if getattr(
                attn, "latent_cache", False) else torch.zeros(shape, dtype=self.kv_dtype, device=self.device)  # MLA
            self.kv_caches.append((attn.k_cache, attn.v_cache))

    # ---- CUDA graphs for pure-decode steps -----------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self, sizes: list[int]) -> None:
        """One graph per decode batch size, sharing a memory pool; largest first so the pool fits all."""
        n, dev = max(sizes), self.device
        self.g_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.g_ctx = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_bt = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.long, device=dev)
        self.g_out = torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype, device=dev)
        self.g_lora = torch.full((n,), -1, dtype=torch.long, device=dev)  # LoRA slots: a graph input like the rest
        pool = None
        for b in sorted(sizes, reverse=True):
            md = AttentionMetadata(self.g_slots[:b], self.g_bt[:b], self.g_ctx[:b], b,
                                   torch.zeros(1, dtype=torch.long, device=dev))
            if self.lora is not None:  # with LoRA on, every graph runs the LoRA kernels (slot -1 rows: no work)
                self.lora.set_batch(self.g_lora[:b])
            self.g_out[:b] = self.model(self.g_ids[:b], self.g_pos[:b], md)  # warm up (compiles kernels)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if self.lora is not None:  # the rows' grouping by slot is computed inside the graph
                    self.lora.set_batch(self.g_lora[:b])
                self.g_out[:b] = self.model(self.g_ids[:b], self.g_pos[:b], md)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize()
        self.graph_sizes = sorted(self.graphs)
        if self.lora is not None:
            self.lora.set_batch(None)

    def _run_graph(self, ids, pos, md: AttentionMetadata, lora_slots=None) -> torch.Tensor | None:
        T = ids.shape[0]
        if not self.graphs or md.num_decodes != T or T > self.graph_sizes[-1]:
            return None
        b = next(s for s in self.graph_sizes if s >= T)
        self.g_ids[:T].copy_(ids)
        self.g_pos[:T].copy_(pos)
        self.g_slots[:T].copy_(md.slot_mapping)
        self.g_slots[T:b].fill_(-1)
        self.g_ctx[:T].copy_(md.context_lens)
        self.g_ctx[T:b].fill_(0)
        self.g_bt[:T, :md.block_tables.shape[1]].copy_(md.block_tables)
        if self.lora is not None:
            if lora_slots is None:
                self.g_lora[:b].fill_(-1)
            else:
                self.g_lora[:T].copy_(lora_slots)
                self.g_lora[T:b].fill_(-1)
        self.graphs[b].replay()
        return self.g_out[:T]

    def build_step(self, sched: SchedulerOutput, table: np.ndarray) -> tuple[StepInputs, list[Request]]:
        """Flatten the step into CPU tensors, and which requests sample. table: the requests' block ids, a row each
        (KVCacheManager.block_table).

        Requests come decodes first (one token each), then prefill chunks; a request samples when this
        step reaches its last known token (a prefill chunk short of that only fills the cache). Built with
        numpy: at 256 decoding requests this is the host work of every step."""
        bs = self.block_size
        reqs, nums = sched.requests, sched.num_scheduled_tokens
        starts = [r.num_computed_tokens for r in reqs]
        known = [len(r.all_token_ids) for r in reqs]  # the host's tokens (num_tokens)
        # A decode whose input token is still on the device (async scheduling) reads it from the last step's
        # sampled tokens; its host id here is a placeholder.
        pending = [i for i, (s, k) in enumerate(zip(starts, known)) if s == k]
        all_pending = len(pending) == len(reqs)  # an async decode step: every row samples, none is a prompt's
        sample_idx = list(range(len(reqs))) if all_pending else [
            i for i, (r, s, n, k) in enumerate(zip(reqs, starts, nums, known)) if s + n == k + r.num_pending]
        sample_reqs = [reqs[i] for i in sample_idx] if len(sample_idx) < len(reqs) else reqs
        if max(nums) == 1:  # pure decode: one token per request
            num_decodes = len(reqs)
            input_ids = np.zeros(len(reqs), np.int64) if all_pending else np.fromiter(
                (r.all_token_ids[s] if s < k else 0 for r, s, k in zip(reqs, starts, known)), np.int64, len(reqs))
            pos = np.array(starts, dtype=np.int64)
            seq_of_token = np.arange(len(reqs))
            context_lens = pos + 1
            cu_seqlens = np.zeros(1, dtype=np.int64)
            sample_rows = np.array(sample_idx, dtype=np.int64)
        else:
            num_decodes = 0
            while num_decodes < len(nums) and nums[num_decodes] == 1:
                num_decodes += 1
            input_ids = np.fromiter(itertools.chain.from_iterable(
                r.all_token_ids[s:s + n] if s < r.num_tokens else (0,) for r, s, n in zip(reqs, starts, nums)),
                np.int64, sum(nums))
            counts = np.array(nums, dtype=np.int64)
            ends = np.cumsum(counts)
            seq_of_token = np.repeat(np.arange(len(reqs)), counts)
            pos = np.arange(len(input_ids), dtype=np.int64) - (ends - counts)[seq_of_token] + \
                np.array(starts, dtype=np.int64)[seq_of_token]
            context_lens = np.array(starts, dtype=np.int64) + counts
            cu_seqlens = np.concatenate([[0], np.cumsum(counts[num_decodes:])]).astype(np.int64)
            sample_rows = ends[sample_idx] - 1 if sample_idx else np.zeros(0, dtype=np.int64)
        slots = table[seq_of_token, pos // bs] * bs + pos % bs
        if self.longrope is not None:  # tokens of prompts longer than LongRoPE's original length: the long factors
            original, offset = self.longrope
            long_prompt = np.fromiter((r.num_prompt_tokens > original for r in reqs), bool, len(reqs))
            if long_prompt.any():
                pos = pos + np.where(long_prompt[seq_of_token] & (pos < original), offset, 0)
        t = torch.from_numpy
        step = StepInputs(t(input_ids), t(pos), t(slots), t(table), t(context_lens), num_decodes, t(cu_seqlens),
                          t(np.ascontiguousarray(sample_rows, dtype=np.int64)))
        if self.lora_slots is not None:  # LoRA: each row's adapter slot (per request, then per token)
            row_slots = self.lora_slots.row_slots(reqs)
            step.lora_loads = self.lora_slots.take_loads()
            if (row_slots >= 0).any():
                step.lora_slots = t(np.ascontiguousarray(row_slots[seq_of_token]))
        step.prompt_lp, self.prompt_segments = (None, []) if all_pending else plan_step(reqs, starts, nums)
        if all_pending and same_requests(reqs, self.last_reqs):
            step.pending_all = True  # a steady decode batch: no index tensors, no gather on the device
        elif pending:  # rows are decodes, so a row index is also its token index
            assert all(nums[i] == 1 for i in pending), "only a decode's input token can be in flight"
            last_rows = {r.request_id: i for i, r in enumerate(self.last_reqs)}
            step.pending_rows = torch.tensor(pending, dtype=torch.long)
            step.pending_src = torch.tensor([last_rows[reqs[i].request_id] for i in pending], dtype=torch.long)
        return step, sample_reqs

    def to_device(self, s: StepInputs):
        """The step's inputs on the model's device. On CUDA: packed into one pinned buffer (two, used in turn)
        and copied in one non-blocking transfer."""
        parts = [s.input_ids, s.positions, s.slot_mapping, s.block_tables, s.context_lens, s.cu_seqlens_q,
                 s.sample_rows]
        if s.pending_rows is not None:
            parts += [s.pending_rows, s.pending_src]
        if s.lora_slots is not None:
            parts.append(s.lora_slots)
        if not self.pin:
            moved = [x.to(self.device) for x in parts]
        else:
            total = sum(x.numel() + 1 for x in parts)  # each part starts 16-byte aligned (see below)
            self._turn ^= 1
            if self._copied[self._turn] is not None:
                self._copied[self._turn].synchronize()  # the buffer's last transfer has left it
            buf = self._staging[self._turn]
            if buf is None or buf.numel() < total:
                buf = self._staging[self._turn] = torch.empty(max(total, 2 * (buf.numel() if buf is not None else 0),
                                                                  1 << 16), dtype=torch.long).pin_memory()
            views, offset = [], 0
            for x in parts:
                n = x.numel()
                buf[offset:offset + n].copy_(x.reshape(-1))
                views.append((offset, n, x.shape))
                offset += n + (n & 1)  # Triton specializes kernels on pointer alignment: keep it fixed
            flat = buf[:total].to(self.device, non_blocking=True)
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
            moved = [flat[o:o + n].view(shape) for o, n, shape in views]
        ids, pos, slots, bt, ctx, cu, rows = moved[:7]
        if s.pending_all:
            ids = self.last_tokens
        elif s.pending_rows is not None:
            ids[moved[7]] = self.last_tokens[moved[8]]
        if self.lora is not None:
            if s.lora_loads:
                self.lora.apply_loads(s.lora_loads)
            self.lora.set_batch(moved[-1] if s.lora_slots is not None else None)
        md = AttentionMetadata(slots, bt, ctx, s.num_decodes, cu)
        return ids, pos, md, rows

    def run_step(self, step: StepInputs | list[StepInputs]) -> torch.Tensor | None:
        """Forward one step (under PP: its micro-batches); the logits of its sampling rows (None when no row
        samples, or on a rank that does not sample)."""
        if get_pp_size() > 1:
            return self._run_pipeline(step)
        ids, pos, md, rows = self.to_device(step)
        lora = self.lora.mapping.slots if self.lora is not None and self.lora.mapping is not None else None
        hidden = self._run_graph(ids, pos, md, lora)
        if hidden is None:
            hidden = self.model(ids, pos, md)
        self.prompt_scores = score(self.model, hidden, step.prompt_lp) if step.prompt_lp is not None else None
        if step.sample_rows.numel() == 0:
            return None
        # every token row samples (a decode step): rows is 0..T-1, so no gather
        return self.model.compute_logits(hidden if rows.shape[0] == hidden.shape[0] else hidden[rows])

    def _run_pipeline(self, micro: list[StepInputs]) -> torch.Tensor | None:
        """Micro-batches flow through the stages: stage s runs micro-batch i while stage s+1 runs i-1. Each stage
        receives (x, residual) from the one before and sends its own on asynchronously (waited at the end, so no
        stage blocks on a peer still computing); the last stage's TP rank 0 sends the logits to rank 0."""
        rank, tp, last = get_rank(), get_tp_size(), (get_pp_size() - 1) * get_tp_size()
        pending, logits = [], []
        for step in micro:
            ids, pos, md, rows = self.to_device(step)
            shape = ((ids.shape[0], self.cfg.hidden_size), self.dtype)
            intermediate = None if get_pp_rank() == 0 else tuple(recv([shape, shape], rank - tp, self.device))
            out = self.model(ids, pos, md, intermediate)
            if rank < last:
                pending.append(isend(list(out), rank + tp))
            elif rows.numel():
                logits.append(self.model.compute_logits(out[rows]))
                if rank == last:
                    pending.append(isend([logits[-1]], 0))
        if rank == 0:
            vocab = self.cfg.vocab_size
            logits = [recv([((s.sample_rows.numel(), vocab), torch.float32)], last, self.device)[0]
                      for s in micro if s.sample_rows.numel()]
        for works in pending:
            for work, _ in works:
                work.wait()
        return torch.cat(logits) if logits else None

    def _micro_batches(self, sched: SchedulerOutput, table: np.ndarray):
        """Under PP: the step's requests in up to pp contiguous groups (decodes stay first in each)."""
        n = min(get_pp_size(), len(sched.requests))
        bounds = [len(sched.requests) * i // n for i in range(n + 1)]
        steps, reqs = [], []
        for a, b in zip(bounds, bounds[1:]):
            sub = SchedulerOutput(sched.requests[a:b], sched.num_scheduled_tokens[a:b])
            step, r = self.build_step(sub, table[a:b])
            steps.append(step)
            reqs += r
        return steps, reqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, table: np.ndarray) -> tuple[list[Request], SamplerOutput]:
        """Run one step and wait for its tokens."""
        reqs, sampled = self.launch(sched, table)
        return reqs, sampled.resolve() if sampled is not None else SamplerOutput([], [])

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, table: np.ndarray,
               bitmask: Callable[[list[Request]], tuple[torch.Tensor, list[int]] | None] | None = None,
               ) -> tuple[list[Request], SampledTokens | None]:
        """Queue one step on the device and return without waiting: the requests that sample and their tokens
        (None when no row samples). Under TP/PP the step is broadcast to the other ranks first. bitmask(reqs) is
        asked once the forward is queued, so the host fills structured outputs' masks while the device runs it."""
        if get_pp_size() > 1:
            step, reqs = self._micro_batches(sched, table)
        else:
            step, reqs = self.build_step(sched, table)
        if get_tp_size() * get_pp_size() > 1:
            broadcast_step(step)  # the other ranks run the same step on their shards
        logits = self.run_step(step)
        if self.prompt_scores is not None:
            keep(self.prompt_segments, self.prompt_scores)
        if logits is None:
            return [], None
        sampled = self.sampler.sample(logits, reqs, bitmask(reqs) if bitmask is not None else None)
        self.last_tokens, self.last_reqs = sampled.tokens, reqs
        return reqs, sampled


@torch.inference_mode()
def profile_peak_activation(model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, max_model_len: int,
                            max_num_seqs: int, block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes a full-budget step needs beyond the weights: one forward over num_tokens prompt tokens (in
    sequences of at most max_model_len) plus logits and sampling for max_num_seqs rows."""
    lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
    blocks_per = [-(-n // block_size) for n in lens]
    runner = ModelRunner(model, cfg, block_size, sum(blocks_per), dtype, device)
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.long)
    start = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = torch.arange(start, start + nb)
        start += nb
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    md = AttentionMetadata((table[seq, pos // block_size] * block_size + pos % block_size).to(device),
                           table.to(device), torch.tensor(lens, device=device), 0,
                           torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device), pos.to(device), md)
    rows = min(max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:rows])
    torch.multinomial(logits.softmax(-1), 1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for attn in model.attention_layers():
        attn.k_cache = attn.v_cache = torch.empty(0)
    del runner, hidden, logits
    torch.cuda.empty_cache()
    return peak
