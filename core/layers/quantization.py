"""Quantized weights for Linear: the checkpoint layouts vserve serves and how each one multiplies.

`QuantConfig.resolve(flag, hf_config)` reads config.json's `quantization_config` (checking it against an
explicit --quantization); `QuantConfig.linear_method(prefix)` gives each Linear its method:

- AWQ (AutoAWQ GEMM, 4-bit), GPTQ (4 or 8-bit, act-order g_idx) and compressed-tensors "pack-quantized" (4 or
  8-bit, symmetric): weight-only, kernels' w4a16_gemm;
- compressed-tensors (llm-compressor) "float-quantized" / "int-quantized", and vLLM's plain "fp8": 8-bit
  weights with a scale per output channel (or per tensor, widened to channels at load); with dynamic per-token
  activation quantization (W8A8: kernels' fp8_linear / int8_linear, or fp8_mm / int8_mm when the kernel that
  produced the input quantized it already: a QuantizedActivation) or without (W8A16: w4a16_gemm's channel layout).

A method registers the checkpoint's own tensors on the layer (names, dtypes and shapes as stored, split over TP
ranks by the layer's weight_loader using each parameter's output_dim/input_dim and packing) and dequantizes in
its kernels, never at load. After loading, process_weights_after_loading may repack them once: 4-bit codes go
into the tensor-core layout (kernels/w4a16_repack.py) where the W4A16 dispatch table (kernels/w4a16_configs.json)
asks for it on this device and shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from vserve.core.config import QUANTIZATION_METHODS
from vserve.kernels import for_device

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FP8_MAX, INT8_MAX = 448.0, 127.0


@dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's linear layers hold.

    kind: the --quantization alias it answers to besides its quant_method (awq, gptq, fp8, int8; int4 for
    compressed-tensors' packed 4-bit). layout: the kernels' name for the tensors (awq, gptq, pack: integer codes
    packed in int32 with per-group scales; channel: 8-bit weights [out, in] with a scale per output channel).
    activations: None (weight-only) or the dtype activations are quantized to, per token.
    """

    kind: str
    layout: str
    checkpoint: str | None  # config.json's quant_method; None: built for --load-format dummy
    bits: int = 8
    group_size: int = -1  # -1: one group over all input features
    desc_act: bool = False  # GPTQ act-order: g_idx maps input channels to groups in any order
    activations: str | None = None
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    def linear_method(self, prefix: str) -> LinearMethod | None:
        """The method of the Linear at `prefix` (its vserve name, e.g. model.layers.0.self_attn.qkv_proj), or None
        when the checkpoint leaves it unquantized."""
        leaf = prefix.rsplit(".", 1)[-1]
        names = [prefix[: -len(leaf)] + s for s in PACKED[leaf]] if leaf in PACKED else [prefix]
        quantized = [self._quantized(n) for n in names]
        if any(quantized) != all(quantized):
            raise ValueError(f"the checkpoint quantizes some of {', '.join(names)} but not all; vserve packs them "
                             f"into one layer and needs all or none")
        if not quantized[0]:
            return None
        return ChannelQuantMethod(self) if self.layout == "channel" else GroupQuantMethod(self)

    def _quantized(self, name: str) -> bool:
        if self.layout == "awq":  # AutoAWQ's modules_to_not_convert are substrings of module names
            return not any(m in name for m in self.ignore)
        return any(_matches(t, name) for t in self.targets) and not any(_matches(i, name) for i in self.ignore)

    def memory_spec(self):
        """The memory planner's QuantSpec for these tensors."""
        from vserve.core.memory import QuantSpec

        group = None if self.group_size == -1 else self.group_size
        if self.layout in ("awq", "gptq"):  # fp16 scales, packed zeros; GPTQ's g_idx
            return QuantSpec(self.kind, self.bits, group, True, g_idx=self.layout == "gptq", act_order=self.desc_act,
                             weight_only=True)
        return QuantSpec(self.kind, self.bits, group, False, 4,  # float32 scales, symmetric
                         weight_only=self.activations is None)

    @classmethod
    def resolve(cls, flag: str | None, hf_config: dict, dummy: bool = False) -> QuantConfig | None:
        """The checkpoint's quantization, checked against --quantization; for dummy weights without a
        quantization_config, the flag's default layout (AWQ/GPTQ 4-bit group 128, FP8/INT8 W8A8)."""
        if flag is not None and flag not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {flag!r}")
        raw = hf_config.get("quantization_config") or hf_config.get("compression_config")
        if raw is None:
            if flag is None:
                return None
            if not dummy:
                raise ValueError(f"--quantization {flag} needs a checkpoint quantized with it, but config.json has "
                                 f"no quantization_config (the weights are not quantized)")
            if flag == "compressed-tensors":
                raise ValueError("--quantization compressed-tensors with --load-format dummy needs a "
                                 "quantization_config in config.json; use fp8 or int8 for dummy 8-bit weights")
            return DUMMY_DEFAULTS[flag]
        qc = from_hf(raw)
        allowed = (qc.checkpoint, qc.kind) if qc.checkpoint == "compressed-tensors" else (qc.checkpoint,)
        if flag is not None and flag not in allowed:
            raise ValueError(f"--quantization {flag} contradicts the checkpoint, whose config.json has "
                             f"quantization_config.quant_method {qc.checkpoint!r} ({qc.describe()}); pass "
                             f"--quantization {allowed[0]} or leave it out")
        return qc

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        if self.layout in ("awq", "gptq"):
            return f"{self.layout.upper()} {self.bits}-bit, {group}{', act-order' if self.desc_act else ''}"
        acts = f"A8 {self.activations} per token" if self.activations else "A16"
        return f"W{self.bits} {'fp8' if self.kind == 'fp8' else 'int'} {group}, {acts}"


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


DUMMY_DEFAULTS = {
    "awq": QuantConfig("awq", "awq", None, bits=4, group_size=128),
    "gptq": QuantConfig("gptq", "gptq", None, bits=4, group_size=128),
    "fp8": QuantConfig("fp8", "channel", None, activations="fp8"),
    "int8": QuantConfig("int8", "channel", None, activations="int8"),
}


def from_hf(q: dict) -> QuantConfig:
    """A QuantConfig from config.json's quantization_config (clear errors for what vserve does not serve)."""
    method = str(q.get("quant_method", "")).lower()

    def refuse(what: str) -> ValueError:
        return ValueError(f"quantization_config ({method}): {what} is not supported")

    if method == "awq":
        bits, group = q.get("bits", q.get("w_bit", 4)), q.get("group_size", q.get("q_group_size", 128))
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise refuse(f"AWQ version {q.get('version')!r} (vserve reads the GEMM layout)")
        if bits != 4 or not q.get("zero_point", True):
            raise refuse(f"AWQ with bits={bits}, zero_point={q.get('zero_point')} (vserve reads 4-bit with zeros)")
        return QuantConfig("awq", "awq", "awq", 4, int(group), ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method == "gptq":
        bits, group = q.get("bits", 4), q.get("group_size", 128)
        if bits not in (4, 8):
            raise refuse(f"GPTQ with bits={bits} (4 or 8 are)")
        if q.get("checkpoint_format", "gptq") != "gptq":
            raise refuse(f"GPTQ checkpoint_format {q.get('checkpoint_format')!r} (vserve reads 'gptq')")
        if q.get("lm_head"):
            raise refuse("a quantized lm_head")
        return QuantConfig("gptq", "gptq", "gptq", bits, int(group), desc_act=bool(q.get("desc_act", False)))
    if method == "fp8":  # vLLM's own fp8 checkpoints: per-tensor weight scales, dynamic activations
        if q.get("weight_block_size"):
            raise refuse("block-wise FP8 (weight_block_size)")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse(f"activation_scheme {q.get('activation_scheme')!r} (dynamic is)")
        return QuantConfig("fp8", "channel", "fp8", activations="fp8", ignore=tuple(q.get("ignored_layers") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(q, refuse)
    raise ValueError(f"quantization_config.quant_method {q.get('quant_method')!r} is not supported; vserve serves "
                     f"awq, gptq, fp8 and compressed-tensors (float-, int- and pack-quantized) checkpoints")


def _compressed_tensors(q: dict, refuse) -> QuantConfig:
    """llm-compressor's schemes: float-quantized (FP8), int-quantized (INT8) and pack-quantized (4/8-bit ints in
    int32, weight-only), symmetric, with dynamic per-token activations for W8A8."""
    fmt = q.get("format")
    if fmt not in ("float-quantized", "int-quantized", "pack-quantized"):
        raise refuse(f"format {fmt!r} (float-quantized, int-quantized and pack-quantized are)")
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise refuse("a config without config_groups")
    if len({repr((g.get("weights"), g.get("input_activations"))) for g in groups}) > 1:
        raise refuse("config_groups with different schemes")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    wtype, bits = "float" if fmt == "float-quantized" else "int", w.get("num_bits")
    if w.get("type") != wtype or bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
        raise refuse(f"{fmt} weights of {bits}-bit {w.get('type')}")
    if not w.get("symmetric", True) or w.get("dynamic") or w.get("actorder") == "group":
        raise refuse("asymmetric, dynamic or act-order (group) weights")
    strategy, group = w.get("strategy"), -1
    if strategy == "group" and fmt == "pack-quantized":
        group = int(w.get("group_size"))
    elif strategy not in ("channel", "tensor"):
        raise refuse(f"weight strategy {strategy!r} (channel, tensor and, when packed, group are)")
    if a is not None:
        if fmt == "pack-quantized" or (a.get("num_bits"), a.get("type")) != (8, wtype) or not a.get("symmetric", 1):
            raise refuse(f"input_activations {a} with {fmt} weights (8-bit {wtype}, symmetric are)")
        if not a.get("dynamic") or a.get("strategy") != "token":
            raise refuse("static or per-tensor input activation scales (dynamic per-token are)")
    kind = "fp8" if wtype == "float" else f"int{bits}"
    layout = "pack" if fmt == "pack-quantized" else "channel"
    targets = tuple(t for grp in groups for t in grp.get("targets") or ("Linear",))
    return QuantConfig(kind, layout, "compressed-tensors", bits, group, activations=kind if a is not None else None,
                       ignore=tuple(q.get("ignore") or ()), targets=targets)


# ---- methods ---------------------------------------------------------------------------------------------------


def make_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None,
               input_dim: int | None, out_pack: int = 1, in_pack: int = 1, split_input: bool = True,
               scalar_ok: bool = False, quantized: bool = True) -> nn.Parameter:
    """Register one checkpoint tensor on the layer with what its weight_loader needs: which dim holds output and
    input features, how many features one stored element covers (8 for int32-packed nibbles, group_size for
    per-group scales), whether a row-parallel layer splits it (False: every rank holds all of it) and whether
    the checkpoint may store one value per shard instead (per-tensor scales)."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.output_dim, p.input_dim, p.out_pack, p.in_pack = output_dim, input_dim, out_pack, in_pack
    p.split_input, p.scalar_ok, p.quantized = split_input, scalar_ok, quantized
    p.weight_loader = layer.weight_loader
    layer.register_parameter(name, p)
    return p


@dataclass(slots=True)
class QuantizedActivation:
    """A W8A8 linear's input, quantized per token by the kernel that produced it (kernels' rms_norm_quant,
    fused_add_rms_norm_quant, silu_and_mul_quant): codes [T, K], their scales [T, 1] float32, and the model dtype
    the activation had (the GEMM's output dtype)."""

    xq: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class LinearMethod:
    """How a Linear holds and multiplies its weight: create_weights registers parameters, apply computes
    x W^T (+ bias), init_dummy fills the parameters with random valid values. input_quant_dtype: the dtype apply
    quantizes x to per token (W8A8), which then may pass x as a QuantizedActivation of it instead; None: x is
    always a tensor in the model dtype."""

    input_quant_dtype: torch.dtype | None = None

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after the checkpoint (or dummy) tensors are in place: any repacking for the kernels."""


class UnquantizedMethod(LinearMethod):
    """weight [out, in] in the model dtype."""

    def create_weights(self, layer: nn.Module) -> None:
        make_param(layer, "weight", (layer.out_features, layer.in_features), torch.get_default_dtype(), 0, 1,
                   quantized=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class GroupQuantMethod(LinearMethod):
    """Integer codes packed in int32 with per-group scales (w4a16_gemm): AWQ and GPTQ (fp16 scales, packed zeros;
    GPTQ's g_idx), compressed-tensors pack-quantized (symmetric, float32 scales)."""

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg

    def create_weights(self, layer: nn.Module) -> None:
        cfg, K, N = self.cfg, layer.in_features, layer.out_features
        per = 32 // cfg.bits
        out_per = per if cfg.layout != "pack" else 1  # AWQ codes and GPTQ/AWQ zeros pack output features
        for sid, size in layer.shard_sizes.items():
            if size % out_per:
                raise ValueError(f"{cfg.layout.upper()} packs {out_per} output features per int32, but this rank's "
                                 f"{sid or 'output'} slice has {size}: lower --tensor-parallel-size")
        k_full = K * layer.input_splits
        gs = k_full if cfg.group_size == -1 else cfg.group_size
        # Row-parallel ranks split the groups with the input features, unless act-order scatters a rank's inputs
        # over all groups (or one group spans every input): then each rank keeps all of them.
        split_groups = not cfg.desc_act and cfg.group_size != -1
        if split_groups and K % gs:
            raise ValueError(f"{cfg.layout.upper()} group size {gs} does not divide this rank's {K} input features "
                             f"({k_full} over {layer.input_splits} ranks): lower --tensor-parallel-size")
        if cfg.layout != "awq" and K % per:
            raise ValueError(f"{cfg.layout.upper()} packs {per} input features per int32, but this rank has {K}")
        groups = K // gs if split_groups else -(-k_full // gs)
        self.full_group_size = gs
        self.group_size = K if cfg.group_size == -1 else gs  # what the kernel reads for contiguous groups
        i32, kw = torch.int32, dict(in_pack=gs, split_input=split_groups)
        if cfg.layout == "awq":
            make_param(layer, "qweight", (K, N // 8), i32, 1, 0, out_pack=8)
            make_param(layer, "qzeros", (groups, N // 8), i32, 1, 0, out_pack=8, **kw)
            make_param(layer, "scales", (groups, N), torch.float16, 1, 0, **kw)
        elif cfg.layout == "gptq":
            make_param(layer, "qweight", (K // per, N), i32, 1, 0, in_pack=per)
            make_param(layer, "qzeros", (groups, N // per), i32, 1, 0, out_pack=per, **kw)
            make_param(layer, "scales", (groups, N), torch.float16, 1, 0, **kw)
            make_param(layer, "g_idx", (K,), i32, None, 0)
        else:
            make_param(layer, "weight_packed", (N, K // per), i32, 0, 1, in_pack=per)
            make_param(layer, "weight_scale", (N, groups), torch.float32, 0, 1, **kw)

    tc_group_size: int | None = None  # set when the weight was repacked into the "tc" layout

    @property
    def layout(self) -> str:
        return "tc" if self.tc_group_size else self.cfg.layout

    def tensors(self, layer: nn.Module) -> tuple:
        """(codes, scales, zeros, g_idx) as w4a16_gemm takes them (tc: g_idx is act-order's K permutation)."""
        if self.tc_group_size:
            return layer.qweight, layer.scales, getattr(layer, "qzeros", None), getattr(layer, "perm", None)
        if self.cfg.layout == "pack":
            return layer.weight_packed, layer.weight_scale, None, None
        g_idx = layer.g_idx if self.cfg.layout == "gptq" and self.cfg.desc_act else None
        return layer.qweight, layer.scales, layer.qzeros, g_idx

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = for_device(x).w4a16_gemm(x, *self.tensors(layer), self.layout, self.cfg.bits,
                                     self.tc_group_size or self.group_size)
        return y if bias is None else y + bias

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack 4-bit AWQ / GPTQ / pack-quantized codes into the tensor-core layout where the dispatch table says
        so for this device and shape (kernels/w4a16_dispatch.py; the committed table never does until tuned). Weights
        the layout cannot hold keep the checkpoint's: 8-bit codes, groups not a multiple of 16 (or of 128 above it),
        a row-parallel rank's slice of an act-order layer (its groups of uneven sizes)."""
        from vserve.kernels.w4a16_dispatch import layout_for
        from vserve.kernels.w4a16_repack import act_order_perm, repack, tc_group_size

        cfg, (codes, scales, zeros, g_idx) = self.cfg, self.tensors(layer)
        K, N = layer.in_features, layer.out_features
        if cfg.bits != 4 or layout_for(codes.device, N, K) != "tc" or tc_group_size(self.group_size, K) is None:
            return
        if g_idx is not None and act_order_perm(g_idx, self.group_size) is None:
            return
        qweight, scales, qzeros, perm, group = repack(codes, scales, zeros, g_idx, cfg.layout, 4, self.group_size, K,
                                                      N)
        for name in ("qweight", "qzeros", "scales", "weight_packed", "weight_scale") + (("g_idx",) if perm is not None
                                                                                        else ()):
            layer._parameters.pop(name, None)
        for name, t in (("qweight", qweight), ("scales", scales), ("qzeros", qzeros), ("perm", perm)):
            if t is not None:
                layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
        self.tc_group_size = group

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random codes, zero points at mid-range, scales giving weights of std ~0.02 (as the dummy floats)."""
        cfg, g = self.cfg, generator
        bits, per = cfg.bits, 32 // cfg.bits
        codes, scales, zeros, _ = self.tensors(layer)
        codes.data.copy_(torch.randint(-2**31, 2**31, codes.shape, generator=g, device=g.device,
                                       dtype=torch.int64).to(torch.int32))
        base = 0.02 * 12**0.5 / 2**bits  # the std of uniform codes around the middle is 2^bits / sqrt(12)
        scales.data.uniform_(0.5 * base, 1.5 * base, generator=g)
        if zeros is not None:
            mid = 2 ** (bits - 1) - (1 if cfg.layout == "gptq" else 0)  # GPTQ stores zero - 1
            word = sum(mid << (bits * i) for i in range(per))
            zeros.data.fill_(word - 2**32 if word >= 2**31 else word)
        if cfg.layout == "gptq":
            k_full = layer.in_features * layer.input_splits
            gidx = torch.arange(k_full, device=g.device, dtype=torch.int32) // self.full_group_size
            if cfg.desc_act:
                gidx = gidx[torch.randperm(k_full, generator=g, device=g.device)]
            start = layer.input_rank * layer.in_features
            layer.g_idx.data.copy_(gidx[start:start + layer.in_features])


@torch.inference_mode()
def warm_up_w4a16(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Run one GEMM of every tc-layout weight kind (shape, group, zeros, act-order) at each row count where the
    dispatch table changes path or launch, so Triton compiles (or loads from its cache) every variant the weights can
    run before the first request: none is compiled inside a step. Returns the number of GEMMs run (0: no tc weight)."""
    from vserve.kernels.w4a16_dispatch import row_keys

    seen, runs = set(), 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, GroupQuantMethod) or not method.tc_group_size:
            continue
        _, _, zeros, perm = method.tensors(layer)
        kind = (layer.out_features, layer.in_features, method.tc_group_size, zeros is None, perm is None)
        if kind in seen:
            continue
        seen.add(kind)
        for m in row_keys(device, layer.out_features, layer.in_features):
            method.apply(layer, torch.zeros(m, layer.in_features, dtype=dtype, device=device), None)
            runs += 1
    return runs


class ChannelQuantMethod(LinearMethod):
    """8-bit weights [out, in] (fp8 e4m3 or int8) with a float32 scale per output channel; activations quantized
    per token (W8A8) or kept in the model dtype (W8A16)."""

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg
        self.dtype = torch.float8_e4m3fn if cfg.kind == "fp8" else torch.int8
        assert cfg.bits == 8 and cfg.activations in (None, cfg.kind), cfg
        self.input_quant_dtype = self.dtype if cfg.activations else None

    def create_weights(self, layer: nn.Module) -> None:
        make_param(layer, "weight", (layer.out_features, layer.in_features), self.dtype, 0, 1)
        make_param(layer, "weight_scale", (layer.out_features, 1), torch.float32, 0, None, scalar_ok=True)

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None) -> torch.Tensor:
        fp8 = self.cfg.activations == "fp8"
        if isinstance(x, QuantizedActivation):
            assert x.xq.dtype == self.input_quant_dtype, (x.xq.dtype, self.input_quant_dtype)
            ops = for_device(x.xq)
            y = (ops.fp8_mm if fp8 else ops.int8_mm)(x.xq, x.scale, layer.weight, layer.weight_scale, x.dtype)
        elif self.input_quant_dtype is not None:
            ops = for_device(x)
            y = (ops.fp8_linear if fp8 else ops.int8_linear)(x, layer.weight, layer.weight_scale)
        else:
            y = for_device(x).w4a16_gemm(x, layer.weight, layer.weight_scale, None, None, "channel", 8,
                                         layer.in_features)
        return y if bias is None else y + bias

    def init_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Quantize a N(0, 0.02) weight per output channel, one slab of rows at a time (bounded temporaries)."""
        qmax = FP8_MAX if self.cfg.kind == "fp8" else INT8_MAX
        for start in range(0, layer.out_features, 4096):
            w = torch.empty(min(4096, layer.out_features - start), layer.in_features, device=generator.device,
                            dtype=torch.float32)
            w.normal_(0.0, 0.02, generator=generator)
            scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / qmax
            v = w / scale
            layer.weight.data[start:start + w.shape[0]] = v.to(self.dtype) if self.cfg.kind == "fp8" else \
                v.round().clamp(-128, 127).to(torch.int8)
            layer.weight_scale.data[start:start + w.shape[0]] = scale

