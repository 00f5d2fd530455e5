"""`vserve quantize`: a float HF model quantized one decoder layer at a time, on the GPU when there is one.

The model is loaded on the CPU (float32; bfloat16 when a GPU computes) and each decoder layer visits the device only
while it is quantized, so the device holds one layer and the calibration activations whatever the model's size. The
calibration samples run through the embeddings once; then each layer's forward is taken in stages, one per group of
linears that share an input (q/k/v, o, gate/up, down): each group is quantized from its inputs as the layer now
computes them (earlier groups already quantized: GPTQ's "true sequential"), and the next stage starts from there, so
a layer costs one forward over the calibration tokens besides its searches. RTN and FP8 (without --gptq or
--smoothquant-alpha) need no calibration and skip all of that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vserve.ops.progress import console, phase_progress
from vserve.quantize import checkpoint
from vserve.quantize.awq import quantize_awq
from vserve.quantize.formats import dequantize_awq, dequantize_gptq, pack_awq, pack_gptq
from vserve.quantize.gptq import quantize_gptq, quantize_gptq_channel
from vserve.quantize.layers import Group, decoder_layers, fold_scales, layer_groups
from vserve.quantize.options import QuantizeOptions
from vserve.quantize.rtn import group_index, quantize_rtn
from vserve.quantize.smoothquant import search_alpha, smooth_scales
from vserve.quantize.w8a8 import dequantize_weight, pack_int8, quantize_weight

CHUNK = 8  # calibration samples per forward: bounds the attention's memory
AWQ_SEARCH_TOKENS = 16384  # tokens whose block output scores each AWQ scale candidate (all tokens give s_x)
CLIP_TOKENS = 512  # strided tokens that score AWQ's clipping (awq.search_clip)
SMOOTH_SEARCH_TOKENS = 2048  # random tokens that score each SmoothQuant alpha (all tokens give max |x|)
PHASES = ("q/k/v", "o", "gate/up", "down")  # the progress bar's steps in a layer: its groups, in layer_groups' order

Packed = dict[str, torch.Tensor]  # one quantized linear's tensors, by suffix: qweight, qzeros, scales, ...


@dataclass(slots=True)
class QuantizeSummary:
    scheme: str
    output_dir: Path
    num_layers: int
    num_linears: int
    calib_samples: int  # 0 when the method needs no calibration
    seq_len: int
    seconds: float
    bytes_before: int
    bytes_after: int
    alphas: list[float | None] = field(default_factory=list)  # AWQ, SmoothQuant: the alpha of each scaled group
    # (None: SmoothQuant's search left the group unsmoothed)
    device: str = "cpu"  # where the forwards and searches ran, and in which dtypes
    calib_note: str | None = None  # the CPU default's line, when the calibration size was the CPU default


@dataclass(frozen=True, slots=True)
class Compute:
    """Where a layer is quantized: the device, the dtype of the model's forwards there, and that of AWQ's scale
    search (its 20 candidate forwards per group are most of AWQ's time; bfloat16 where the device computes it fast,
    the quantization itself always in float32 or float64)."""

    device: torch.device
    dtype: torch.dtype
    search_dtype: torch.dtype

    def describe(self, awq: bool) -> str:
        name = str(self.device)
        if self.device.type == "cuda":
            name += f" ({torch.cuda.get_device_name(self.device)})"
        search = f", AWQ search in {_dtype_name(self.search_dtype)}" if awq and self.search_dtype != self.dtype else ""
        return f"{name}, {_dtype_name(self.dtype)} forwards{search}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(name: str) -> torch.device:
    """--device: auto is cuda when torch sees a GPU, else cpu; cuda without one is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch sees no CUDA device (torch.cuda.is_available() is False); "
                             f"use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def _cpu_bf16_is_fast() -> bool:
    """A CPU with bfloat16 dot products (AVX512-BF16 or AMX): there a bfloat16 matmul is about 4x float32's (seen
    on this repo's AMD EPYC); elsewhere it is emulated and slower."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, c, lambda: False)() for c in checks)


def compute_for(device: torch.device) -> Compute:
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return Compute(device, dtype, dtype)
    return Compute(device, torch.float32, torch.bfloat16 if _cpu_bf16_is_fast() else torch.float32)


class _Stop(Exception):
    """Raised by a hook once it has what it came for: the rest of the forward is not needed."""


def _run(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _input_of(module: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input module receives while run() runs (stopped there: nothing after it is computed)."""
    got = []

    def hook(_m, args):
        got.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    assert got, f"{type(module).__name__} was not reached"
    return got[0]


def _attention(attn: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return attn(hidden_states=x, position_embeddings=kwargs["position_embeddings"],
                attention_mask=kwargs.get("attention_mask"))[0]


def _attention_core(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """o_proj's input: the attention of the normed x before its output projection."""
    return _input_of(layer.self_attn.o_proj, lambda: _attention(layer.self_attn, layer.input_layernorm(x), kwargs))


def _mlp_core(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """down_proj's input: act(gate(x)) * up(x) of the normed h."""
    return _input_of(layer.mlp.down_proj, lambda: layer.mlp(layer.post_attention_layernorm(h)))


def _layer_output(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The layer's forward as the stages take it: h = x + o(attention), out = h + down(mlp core)."""
    h = x + layer.self_attn.o_proj(_attention_core(layer, x, kwargs))
    return h + layer.mlp.down_proj(_mlp_core(layer, h))


def check_stages(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> None:
    """The staged forward must compute what the layer's own forward does (a Llama-like pre-norm layer)."""
    ref = _run(layer, x, kwargs)
    err = ((_layer_output(layer, x, kwargs) - ref).float().norm() / ref.float().norm()).item()
    if not err < 1e-2:
        raise ValueError(f"{type(layer).__name__} does not compute h = x + o_proj(attention(input_layernorm(x))), "
                         f"h + down_proj(mlp(post_attention_layernorm(h))) (relative difference {err:.2g}): "
                         f"vserve quantize supports Llama-like layers only")


def first_layer_inputs(model: nn.Module, layer0: nn.Module, samples: torch.Tensor) -> tuple[list, dict]:
    """(hidden states entering layer 0, one tensor per chunk of samples; the layer's other kwargs). The kwargs
    come from a batch of one sample: positions and mask are the same for every sample and broadcast."""
    got = []

    def hook(_m, args, kwargs):
        hs = args[0] if args else kwargs.pop("hidden_states")
        got.append((hs.detach(), dict(kwargs)))
        raise _Stop

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in [samples[:1], *samples.split(CHUNK)]:
            try:
                model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return [hs for hs, _ in got[1:]], got[0][1]


@contextmanager
def _dtype(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The module's parameters in dtype for a while (no copy when they are in it already)."""
    saved = [(p, p.data) for p in module.parameters() if p.dtype != dtype]
    for p, data in saved:
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def _block_forward(layer: nn.Module, group: Group, linears: list[nn.Linear], xs: list[torch.Tensor],
                   kwargs: dict, dtype: torch.dtype) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """forward(weights) -> the output on xs of the group's block (attention, MLP, or the linear alone when the
    group has no block) with those weights in place of the group's, computed in dtype (call it inside
    `_dtype(block, dtype)`, which _awq_group does)."""
    block = layer.get_submodule(group.block or group.linears[0])
    xs = [x.to(dtype) for x in xs]
    kw = {k: tuple(t.to(dtype) for t in v) if k == "position_embeddings" else v for k, v in kwargs.items()}
    mask = kw.get("attention_mask")
    if mask is not None and mask.is_floating_point():
        kw["attention_mask"] = mask.to(dtype)

    def call(x):
        return _attention(block, x, kw) if group.block == "self_attn" else block(x)

    def forward(weights: list[torch.Tensor]) -> torch.Tensor:
        saved = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, weights):
                lin.weight.data = w.to(dtype)
            return torch.cat([call(x) for x in xs])
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.data = w

    return forward


def _divide_rows(packed: Packed, layout: str, s: torch.Tensor) -> None:
    """Fold 1/s into an already-quantized linear's output rows: (q - z) * scale / s keeps every code."""
    if layout == "awq":
        packed["scales"] = (packed["scales"].float() / s[None, :]).half()
    else:  # compressed-tensors, channel-wise
        packed["weight_scale"] = packed["weight_scale"] / s[:, None]


def _dequantize(packed: Packed, opts: QuantizeOptions) -> torch.Tensor:
    """The float weight a linear's stored tensors stand for."""
    if opts.layout == "awq":
        return dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"], opts.group_size)
    if opts.layout == "gptq":
        return dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], opts.bits)
    q = packed.get("weight")
    if q is None:
        from vserve.quantize.w8a8 import unpack_int8

        q = unpack_int8(packed["weight_packed"])
    return dequantize_weight(q, packed["weight_scale"])


def _pack_rtn_style(w: torch.Tensor, opts: QuantizeOptions) -> Packed:
    """Weights that need no calibration: RTN (AWQ GEMM for 4 bits, GPTQ for 8) and 8-bit channel-wise."""
    if opts.method in ("fp8", "int8"):
        return _pack_channel(*quantize_weight(w, opts.method), opts)
    q, zeros, scales = quantize_rtn(w, opts.bits, opts.group_size)
    if opts.bits == 4:
        return dict(zip(("qweight", "qzeros", "scales"), pack_awq(q, zeros, scales)))
    g_idx = group_index(w.shape[1], opts.group_size)
    return dict(zip(("qweight", "qzeros", "scales", "g_idx"), pack_gptq(q, zeros, scales, g_idx, opts.bits)))


def _pack_channel(q: torch.Tensor, scale: torch.Tensor, opts: QuantizeOptions) -> Packed:
    """8-bit per-channel weights as compressed-tensors stores them (int8 W8A16: pack-quantized)."""
    if opts.method == "int8" and opts.weight_only:
        return {"weight_packed": pack_int8(q), "weight_scale": scale,
                "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    return {"weight": q, "weight_scale": scale}


def quantize_layer(layer: nn.Module, xs: list[torch.Tensor] | None, kwargs: dict, opts: QuantizeOptions,
                   alphas: list[float | None], compute: Compute,
                   done: Callable[[str], None] = lambda phase: None) -> tuple[dict[str, Packed], list | None]:
    """Quantize every linear of one decoder layer in place (its weight becomes the dequantized weight, so the layer
    computes what the quantized model will) and return (the tensors to store by linear name, the layer's outputs
    on xs, the next layer's inputs: None without calibration). done(phase) is called as each group is finished."""
    out: dict[str, Packed] = {}
    groups = layer_groups(layer, opts.method)
    assert len(groups) == len(PHASES)

    def group(i: int, inputs: list[torch.Tensor] | None) -> bool:
        """Quantize groups[i] from its inputs; True when a scale was folded into them (they changed)."""
        g = groups[i]
        linears = [layer.get_submodule(n) for n in g.linears]
        quantize_group = {"awq": _awq_group, "gptq": _gptq_group}.get(opts.method, _plain_group)
        folded = quantize_group(layer, g, linears, inputs, opts, out, alphas, compute, kwargs)
        for name, lin in zip(g.linears, linears):
            lin.weight.data = _dequantize(out[name], opts).to(lin.weight.dtype)
        done(PHASES[i])
        return folded

    if xs is None:
        for i in range(len(groups)):
            group(i, None)
        return out, None
    # The stages of the layer's forward (check_stages verified them on layer 0): each group's inputs as the layer
    # computes them with the groups before it quantized; recomputed where a fold changed them.
    group(0, [layer.input_layernorm(x) for x in xs])
    attn = [_attention_core(layer, x, kwargs) for x in xs]
    if group(1, attn):  # AWQ's v -> o fold (no GQA)
        attn = [_attention_core(layer, x, kwargs) for x in xs]
    hs = [x + layer.self_attn.o_proj(a) for x, a in zip(xs, attn)]
    del attn
    group(2, [layer.post_attention_layernorm(h) for h in hs])
    acts = [_mlp_core(layer, h) for h in hs]
    if group(3, acts):  # up -> down
        acts = [_mlp_core(layer, h) for h in hs]
    return out, [h + layer.mlp.down_proj(a) for h, a in zip(hs, acts)]


def _tokens(x: torch.Tensor) -> int:
    return x.shape[:-1].numel()


def _strided(xs: list[torch.Tensor], stride: int) -> torch.Tensor:
    """Rows 0, stride, 2 stride, ... of the chunks' tokens concatenated, without concatenating them all."""
    rows, offset = [], 0
    for x in xs:
        x = x.reshape(-1, x.shape[-1])
        rows.append(x[(-offset) % stride::stride])
        offset += x.shape[0]
    return torch.cat(rows)


def _awq_group(layer, group: Group, linears, xs, opts: QuantizeOptions, out: dict, alphas: list, compute: Compute,
               kwargs: dict) -> bool:
    n = sum(_tokens(x) for x in xs)
    act_mean = sum(x.reshape(-1, x.shape[-1]).float().abs().sum(dim=0) for x in xs) / n
    weights = [lin.weight.data for lin in linears]  # the layer's dtype: the search below swaps in others
    scale_search = group.prev is not None
    block = layer.get_submodule(group.block or group.linears[0])
    with _dtype(block, compute.search_dtype):
        search = xs[:max(1, AWQ_SEARCH_TOKENS // _tokens(xs[0]))]
        forward = _block_forward(layer, group, linears, search, kwargs, compute.search_dtype) if scale_search \
            else None
        result = quantize_awq(weights, _strided(xs, max(1, n // CLIP_TOKENS)).float(), opts.bits, opts.group_size,
                              duo_scaling=True, forward=forward,
                              clip=[not name.endswith(("q_proj", "k_proj")) for name in group.linears],  # as AutoAWQ
                              scale_search=scale_search, act_mean=act_mean)
    if scale_search:
        alphas.append(result.alpha)
        _fold(layer, group, result.scales, out, opts)
    for name, (q, zeros, scales) in zip(group.linears, result.layers):
        out[name] = dict(zip(("qweight", "qzeros", "scales"), pack_awq(q, zeros, scales)))
    return scale_search


def _hessian(xs: list[torch.Tensor]) -> torch.Tensor:
    """gptq.hessian of the inputs, accumulated chunk by chunk."""
    n = xs[0].shape[-1]
    h = torch.zeros(n, n, dtype=torch.float64, device=xs[0].device)
    count = 0
    for x in xs:
        x = x.reshape(-1, n).float()
        h += (x.t() @ x).double()
        count += x.shape[0]
    return 2 * h / count


def _split_rows(linears: list[nn.Linear]) -> list[slice]:
    """Each linear's rows in their weights stacked (GPTQ sweeps the linears sharing an input, and so H, at once:
    it treats rows independently, so that is the same as one sweep per linear, with fewer steps)."""
    ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
    return [slice(a, b) for a, b in zip([0, *ends], ends)]


def _gptq_group(layer, group: Group, linears, xs, opts: QuantizeOptions, out: dict, alphas: list, compute: Compute,
                kwargs: dict) -> bool:
    H = _hessian(xs)
    q, zeros, scales, g_idx = quantize_gptq(torch.cat([lin.weight.data for lin in linears]), H, opts.bits,
                                            opts.group_size, act_order=opts.desc_act, sym=opts.sym)
    for name, r in zip(group.linears, _split_rows(linears)):
        out[name] = dict(zip(("qweight", "qzeros", "scales", "g_idx"),
                             pack_gptq(q[r], zeros[r], scales[r], g_idx.clone(), opts.bits, opts.sym)))
    return False


def _plain_group(layer, group: Group, linears, xs, opts: QuantizeOptions, out: dict, alphas: list, compute: Compute,
                 kwargs: dict) -> bool:
    """RTN, FP8, INT8: each weight on its own, after SmoothQuant's smoothing for W8A8 when asked (INT8's default);
    with --gptq the 8-bit weights are rounded with GPTQ's error feedback on the (smoothed) inputs."""
    s = None
    if opts.smoothquant_alpha is not None and group.prev is not None:
        s, alpha = _smoothing(linears, xs, opts)
        alphas.append(alpha)
        if alpha is None:
            s = None
        else:
            _fold(layer, group, s, out, opts)
            for lin in linears:
                lin.weight.data.mul_(s[None, :].to(lin.weight.dtype))
    if not opts.gptq:
        for name, lin in zip(group.linears, linears):
            out[name] = _pack_rtn_style(lin.weight.data, opts)
        return s is not None
    H = _hessian(xs)
    if s is not None:  # the smoothed inputs x / s
        s64 = s.double()
        H = H / (s64[:, None] * s64[None, :])
    q, scale = quantize_gptq_channel(torch.cat([lin.weight.data for lin in linears]), H, opts.method,
                                     act_order=opts.desc_act)
    for name, r in zip(group.linears, _split_rows(linears)):
        out[name] = _pack_channel(q[r].clone(), scale[r].clone(), opts)  # no storage shared in the file
    return s is not None


def _smoothing(linears, xs, opts: QuantizeOptions) -> tuple[torch.Tensor, float | None]:
    """(SmoothQuant's scales for the linears, the alpha): max |x| from all the inputs; alpha as given, or "auto":
    searched (smoothquant.search_alpha) on SMOOTH_SEARCH_TOKENS of them drawn at random (seed --seed)."""
    device = xs[0].device
    amax = torch.zeros(linears[0].in_features, device=device)
    auto = opts.smoothquant_alpha == "auto"
    if auto:  # which tokens score the candidates
        n = sum(_tokens(x) for x in xs)
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed))[:SMOOTH_SEARCH_TOKENS]
        pick = pick.to(device)
        picked = torch.empty(len(pick), linears[0].in_features, device=device)
    seen = 0  # tokens gone through so far
    for x in xs:
        x = x.reshape(-1, x.shape[-1]).float()
        torch.maximum(amax, x.abs().amax(dim=0), out=amax)
        if auto:
            rows = ((pick >= seen) & (pick < seen + x.shape[0])).nonzero().squeeze(1)
            picked[rows] = x[pick[rows] - seen]
        seen += x.shape[0]
    weights = [lin.weight for lin in linears]
    if not auto:
        return smooth_scales(amax, weights, opts.smoothquant_alpha), opts.smoothquant_alpha
    return search_alpha(picked, weights, opts.method, amax)


def _fold(layer: nn.Module, group: Group, s: torch.Tensor, out: dict[str, Packed], opts: QuantizeOptions) -> None:
    """x / s at the group's input: into the norm's weight, or the preceding linear's rows (and its stored
    tensors, when that linear was quantized by an earlier group of this layer)."""
    prev = layer.get_submodule(group.prev)
    fold_scales(prev, [], s)
    if group.prev in out:
        _divide_rows(out[group.prev], opts.layout, s)
        prev.weight.data = _dequantize(out[group.prev], opts).to(prev.weight.dtype)


@contextmanager
def source_folder(model: str | None) -> Iterator[Path]:
    """The HF folder to quantize: MODEL (a local path or hub id), the embedded default when None, or a GGUF
    converted to a temporary one."""
    import tempfile

    from vserve.core.config import EngineConfig
    from vserve.core.hub import resolve_model_files
    from vserve.core.model_config import resolve_model
    from vserve.ops.assets import convert_gguf_to_hf, default_model_path

    if model is None:
        yield default_model_path()
        return
    path, fmt = resolve_model(resolve_model_files(EngineConfig(model=model)).model, "auto")  # a hub id: its snapshot
    if fmt != "gguf":
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="vserve-gguf-") as tmp:
        convert_gguf_to_hf(path, Path(tmp) / "model")
        yield Path(tmp) / "model"


def load_model(folder: Path, dtype: torch.dtype = torch.float32):
    """The HF model on the CPU in dtype (quantize moves one decoder layer at a time to the device)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if checkpoint.quantization_config_of(folder) is not None:
        raise ValueError(f"{folder} is already quantized (its config.json has a quantization_config)")
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    return model


def quantize(model_path: str | None, opts: QuantizeOptions) -> QuantizeSummary:
    """Quantize MODEL with opts (already validated) into opts.output_dir."""
    opts.validate()
    start = time.perf_counter()
    with source_folder(model_path) as folder:
        if opts.backend == "autoawq":
            from vserve.quantize.autoawq import quantize_with_autoawq

            note = opts.fill_calibration("cpu")  # AutoAWQ runs on the CPU here
            n_samples = quantize_with_autoawq(folder, opts)
            return QuantizeSummary(opts.scheme, opts.output_dir, -1, -1, n_samples, opts.seq_len,
                                   time.perf_counter() - start, checkpoint.folder_bytes(folder),
                                   checkpoint.folder_bytes(opts.output_dir), device="cpu, float32 (AutoAWQ)",
                                   calib_note=note)
        compute = compute_for(resolve_device(opts.device))
        note = opts.fill_calibration(compute.device.type)
        model = load_model(folder, compute.dtype)
        prefix, layers = decoder_layers(model)
        opts.check_shapes(model)
        with torch.inference_mode():
            return _quantize_loaded(model, prefix, layers, folder, opts, start, compute, note)


@contextmanager
def _on(device: torch.device, modules: list[nn.Module]) -> Iterator[None]:
    """The modules on device for a while, then back on the CPU."""
    for m in modules:
        m.to(device)
    try:
        yield
    finally:
        for m in modules:
            m.to("cpu")


def _quantize_loaded(model, prefix: str, layers, folder: Path, opts: QuantizeOptions, start: float,
                     compute: Compute, note: str | None) -> QuantizeSummary:
    xs, kwargs, n_samples = None, {}, 0
    if opts.needs_calibration:
        from vserve.quantize.calibration import calibration_samples, calibration_token_ids

        ids = calibration_token_ids(folder, opts.calib_data)
        samples = calibration_samples(ids, opts.num_samples, opts.seq_len, opts.seed)
        n_samples = samples.shape[0]
        if note:
            console.print(note)
        around = [m for name, m in model.model.named_children() if name != "layers"]  # embeddings, rotary
        with _on(compute.device, around):
            xs, kwargs = first_layer_inputs(model, layers[0], samples.to(compute.device))
    tensors: dict[str, torch.Tensor] = {}
    alphas: list[float | None] = []
    with phase_progress(f"Quantizing ({opts.scheme})", len(layers), PHASES) as done:
        for i, layer in enumerate(layers):
            with _on(compute.device, [layer]):
                if i == 0 and xs is not None:
                    check_stages(layer, xs[0], kwargs)
                packed, xs = quantize_layer(layer, xs, kwargs, opts, alphas, compute,
                                            lambda phase, i=i: done(i, phase))
            for name, linear in packed.items():
                for suffix, t in linear.items():
                    tensors[f"{prefix}.{i}.{name}.{suffix}"] = t.cpu()
    quantized = {k.rsplit(".", 1)[0] for k in tensors}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, t in model.state_dict().items():
        if name.removesuffix(".weight") in quantized and name.endswith(".weight"):
            continue
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = t.to(opts.dtype) if t.is_floating_point() else t
    checkpoint.write_folder(opts.output_dir, folder, opts.quantization_config(), opts.dtype_name, tensors,
                            opts.overwrite)
    return QuantizeSummary(opts.scheme, opts.output_dir, len(layers), len(quantized), n_samples, opts.seq_len,
                           time.perf_counter() - start, checkpoint.folder_bytes(folder),
                           checkpoint.folder_bytes(opts.output_dir), alphas, compute.describe(opts.method == "awq"),
                           note)
