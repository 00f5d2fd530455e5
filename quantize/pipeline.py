"""`vserve quantize`: a float HF model (float32, CPU, transformers) quantized one decoder layer at a time.

The calibration samples run through the model once up to layer 0; then, for each layer, each group of linears
that shares an input (q/k/v, o, gate/up, down) is quantized from its inputs as the layer now computes them
(earlier groups already quantized: GPTQ's "true sequential"), and the layer's outputs are recomputed with its
quantized weights to become the next layer's inputs. RTN and FP8 (without --gptq or --smoothquant-alpha) need no
calibration and skip all of that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vserve.ops.progress import progress_bar
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
SMOOTH_SEARCH_TOKENS = 2048  # random tokens that score each SmoothQuant alpha (all tokens give max |x|)

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


class _Stop(Exception):
    """Raised by a hook once it has what it came for: the rest of the forward is not needed."""


def _run(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def capture_inputs(layer: nn.Module, xs: list[torch.Tensor], kwargs: dict, module: nn.Module,
                   fn: Callable[[torch.Tensor], None]) -> None:
    """Run the layer on each chunk only as far as `module`, handing fn the module's input for each chunk."""
    def hook(_m, args):
        fn(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        for x in xs:
            try:
                _run(layer, x, kwargs)
            except _Stop:
                pass
    finally:
        handle.remove()


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


def _block_forward(layer: nn.Module, group: Group, linears: list[nn.Linear], xs: list[torch.Tensor],
                   kwargs: dict) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """forward(weights) -> the output on xs of the group's block (attention, MLP, or the linear alone when the
    group has no block) with those weights in place of the group's."""
    block = layer.get_submodule(group.block or group.linears[0])

    def call(x):
        if group.block == "self_attn":
            return block(hidden_states=x, position_embeddings=kwargs["position_embeddings"],
                         attention_mask=kwargs.get("attention_mask"))[0]
        return block(x)

    def forward(weights: list[torch.Tensor]) -> torch.Tensor:
        saved = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, weights):
                lin.weight.data = w
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
                   alphas: list[float | None]) -> dict[str, Packed]:
    """Quantize every linear of one decoder layer in place (its weight becomes the dequantized weight, so the
    layer computes what the quantized model will) and return the tensors to store, by linear name."""
    out: dict[str, Packed] = {}
    quantize_group = {"awq": _awq_group, "gptq": _gptq_group}.get(opts.method, _plain_group)
    for group in layer_groups(layer, opts.method):
        linears = [layer.get_submodule(n) for n in group.linears]
        quantize_group(layer, group, linears, xs, kwargs, opts, out, alphas)
        for name, lin in zip(group.linears, linears):
            lin.weight.data = _dequantize(out[name], opts).to(lin.weight.dtype)
    return out


def _awq_group(layer, group: Group, linears, xs, kwargs, opts: QuantizeOptions, out: dict, alphas: list) -> None:
    chunks: list[torch.Tensor] = []
    capture_inputs(layer, xs, kwargs, linears[0], chunks.append)
    x = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])
    search = chunks[:max(1, AWQ_SEARCH_TOKENS // chunks[0].shape[:-1].numel())]
    result = quantize_awq([lin.weight for lin in linears], x, opts.bits, opts.group_size, duo_scaling=True,
                          forward=_block_forward(layer, group, linears, search, kwargs),
                          clip=[not n.endswith(("q_proj", "k_proj")) for n in group.linears],  # as AutoAWQ
                          scale_search=group.prev is not None)
    if group.prev is not None:
        alphas.append(result.alpha)
        _fold(layer, group, result.scales, out, opts)
    for name, (q, zeros, scales) in zip(group.linears, result.layers):
        out[name] = dict(zip(("qweight", "qzeros", "scales"), pack_awq(q, zeros, scales)))


def _hessian(layer, xs, kwargs, linear: nn.Linear) -> torch.Tensor:
    """gptq.hessian of the linear's calibration inputs, accumulated chunk by chunk."""
    n = linear.in_features
    acc = {"h": torch.zeros(n, n, dtype=torch.float64), "n": 0}

    def add(x):
        x = x.reshape(-1, n).float()
        acc["h"] += (x.t() @ x).double()
        acc["n"] += x.shape[0]

    capture_inputs(layer, xs, kwargs, linear, add)
    return 2 * acc["h"] / acc["n"]


def _gptq_group(layer, group: Group, linears, xs, kwargs, opts: QuantizeOptions, out: dict, alphas: list) -> None:
    H = _hessian(layer, xs, kwargs, linears[0])
    for name, lin in zip(group.linears, linears):
        q, zeros, scales, g_idx = quantize_gptq(lin.weight, H, opts.bits, opts.group_size, act_order=opts.desc_act,
                                                sym=opts.sym)
        out[name] = dict(zip(("qweight", "qzeros", "scales", "g_idx"),
                             pack_gptq(q, zeros, scales, g_idx, opts.bits, opts.sym)))


def _plain_group(layer, group: Group, linears, xs, kwargs, opts: QuantizeOptions, out: dict, alphas: list) -> None:
    """RTN, FP8, INT8: each weight on its own, after SmoothQuant's smoothing for W8A8 when asked (INT8's default);
    with --gptq the 8-bit weights are rounded with GPTQ's error feedback on the (smoothed) inputs."""
    if opts.smoothquant_alpha is not None and group.prev is not None:
        s, alpha = _smoothing(layer, linears, xs, kwargs, opts)
        alphas.append(alpha)
        if alpha is not None:
            _fold(layer, group, s, out, opts)
            for lin in linears:
                lin.weight.data.mul_(s[None, :])
    H = _hessian(layer, xs, kwargs, linears[0]) if opts.gptq else None  # after the fold: smoothed inputs
    for name, lin in zip(group.linears, linears):
        if H is None:
            out[name] = _pack_rtn_style(lin.weight.data, opts)
        else:
            out[name] = _pack_channel(*quantize_gptq_channel(lin.weight.data, H, opts.method,
                                                             act_order=opts.desc_act), opts)


def _smoothing(layer, linears, xs, kwargs, opts: QuantizeOptions) -> tuple[torch.Tensor, float | None]:
    """(SmoothQuant's scales for the linears, the alpha): max |x| from all the captured inputs; alpha as given, or
    "auto": searched (smoothquant.search_alpha) on SMOOTH_SEARCH_TOKENS of them drawn at random (seed --seed)."""
    amax = torch.zeros(linears[0].in_features)
    auto = opts.smoothquant_alpha == "auto"
    if auto:  # which tokens score the candidates, chosen before the capture so only those are kept
        n = sum(x.shape[:-1].numel() for x in xs)
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed))[:SMOOTH_SEARCH_TOKENS]
        picked = torch.empty(len(pick), linears[0].in_features)
    seen = 0  # tokens captured so far

    def track(x):
        nonlocal seen
        x = x.reshape(-1, x.shape[-1]).float()
        torch.maximum(amax, x.abs().amax(dim=0), out=amax)
        if auto:
            rows = ((pick >= seen) & (pick < seen + x.shape[0])).nonzero().squeeze(1)
            picked[rows] = x[pick[rows] - seen]
        seen += x.shape[0]

    capture_inputs(layer, xs, kwargs, linears[0], track)
    weights = [lin.weight for lin in linears]
    if not auto:
        return smooth_scales(amax, weights, opts.smoothquant_alpha), opts.smoothquant_alpha
    assert seen == n, (seen, n)
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
    from vserve.core.loader import resolve_model
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


def load_model(folder: Path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if checkpoint.quantization_config_of(folder) is not None:
        raise ValueError(f"{folder} is already quantized (its config.json has a quantization_config)")
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model


def quantize(model_path: str | None, opts: QuantizeOptions) -> QuantizeSummary:
    """Quantize MODEL with opts (already validated) into opts.output_dir."""
    opts.validate()
    start = time.perf_counter()
    with source_folder(model_path) as folder:
        if opts.backend == "autoawq":
            from vserve.quantize.autoawq import quantize_with_autoawq

            n_samples = quantize_with_autoawq(folder, opts)
            return QuantizeSummary(opts.scheme, opts.output_dir, -1, -1, n_samples, opts.seq_len,
                                   time.perf_counter() - start, checkpoint.folder_bytes(folder),
                                   checkpoint.folder_bytes(opts.output_dir))
        model = load_model(folder)
        prefix, layers = decoder_layers(model)
        opts.check_shapes(model)
        with torch.inference_mode():
            return _quantize_loaded(model, prefix, layers, folder, opts, start)


def _quantize_loaded(model, prefix: str, layers, folder: Path, opts: QuantizeOptions, start: float) -> QuantizeSummary:
    xs, kwargs, n_samples = None, {}, 0
    if opts.needs_calibration:
        from vserve.quantize.calibration import calibration_samples, calibration_token_ids

        ids = calibration_token_ids(folder, opts.calib_data)
        samples = calibration_samples(ids, opts.num_samples, opts.seq_len, opts.seed)
        n_samples = samples.shape[0]
        xs, kwargs = first_layer_inputs(model, layers[0], samples)
    tensors: dict[str, torch.Tensor] = {}
    alphas: list[float | None] = []
    for i in progress_bar(range(len(layers)), len(layers), f"Quantizing ({opts.scheme})"):
        layer = layers[i]
        for name, packed in quantize_layer(layer, xs, kwargs, opts, alphas).items():
            for suffix, t in packed.items():
                tensors[f"{prefix}.{i}.{name}.{suffix}"] = t
        if xs is not None and i + 1 < len(layers):
            xs = [_run(layer, x, kwargs) for x in xs]
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
                           checkpoint.folder_bytes(opts.output_dir), alphas)
