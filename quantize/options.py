"""What `vserve quantize` was asked for, validated before any model is loaded (no torch at import)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vserve.quantize import checkpoint

METHODS = ("awq", "gptq", "rtn", "fp8", "int8")
BACKENDS = ("native", "autoawq")
BITS = {"awq": (4,), "gptq": (4, 8), "rtn": (4, 8), "fp8": (8,), "int8": (8,)}
_WHY = {"awq": "the AutoAWQ GEMM layout is 4-bit", "fp8": "FP8 is 8-bit", "int8": "INT8 is 8-bit",
        "gptq": "GPTQ packs 4 or 8 bits", "rtn": "RTN packs 4 or 8 bits"}
DEVICES = ("auto", "cpu", "cuda")  # or cuda:N
# (--num-samples, --seq-len) when not given, by device type: AutoAWQ's 128 x 512 on a GPU; on a CPU 16 x 512, which
# quantizes SmolLM2-135M with AWQ in about 4 minutes on 2 cores at the quality of the 32 x 512 rows
# (docs/quantization.md, "Speed")
CALIBRATION_DEFAULTS = {"cuda": (128, 512), "cpu": (16, 512)}


@dataclass(slots=True)
class QuantizeOptions:
    method: str
    output_dir: Path
    bits: int | None = None  # None: 4 for awq/gptq/rtn, 8 for fp8/int8
    group_size: int = 128
    calib_data: str = "shakespeare"
    num_samples: int | None = None  # None: CALIBRATION_DEFAULTS for the device
    seq_len: int | None = None
    device: str = "auto"  # auto: cuda when torch sees one, else cpu
    backend: str = "native"
    sym: bool = False  # gptq
    desc_act: bool = False  # gptq
    weight_only: bool = False  # fp8 / int8: W8A16
    gptq: bool = False  # fp8 / int8: GPTQ error-feedback rounding of the per-channel weights
    smoothquant_alpha: float | str | None = None  # W8A8: in [0, 1] or "auto"; None: auto (int8), no smoothing (fp8)
    overwrite: bool = False
    seed: int = 0

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "autoawq" and self.method != "awq":
            raise ValueError(f"--backend autoawq quantizes with --method awq only, got --method {self.method}")
        if self.backend == "autoawq" and self.device not in ("auto", "cpu"):
            raise ValueError(f"--backend autoawq runs AutoAWQ on the CPU here; --device {self.device} applies to "
                             "--backend native")
        if self.bits is None:
            self.bits = BITS[self.method][0]
        if self.bits not in BITS[self.method]:
            allowed = " or ".join(map(str, BITS[self.method]))
            raise ValueError(f"--method {self.method} takes --bits {allowed} ({_WHY[self.method]}), got {self.bits}")
        if self.method in ("awq", "gptq", "rtn") and self.group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {self.group_size}")
        if self.sym and self.method != "gptq":
            raise ValueError("--sym applies to --method gptq only")
        if self.desc_act and self.method != "gptq" and not self.gptq:
            raise ValueError("--desc-act applies to --method gptq (or fp8 / int8 with --gptq) only")
        if self.weight_only and self.method not in ("fp8", "int8"):
            raise ValueError(f"--weight-only applies to --method fp8 or int8 (AWQ, GPTQ and RTN are weight-only "
                             f"already), got --method {self.method}")
        if self.gptq and self.method not in ("fp8", "int8"):
            raise ValueError(f"--gptq applies to --method fp8 or int8 (for 4-bit GPTQ use --method gptq), got "
                             f"--method {self.method}")
        if self.smoothquant_alpha is not None:
            if self.method not in ("fp8", "int8") or self.weight_only:
                raise ValueError("--smoothquant-alpha applies to W8A8 only (--method fp8 or int8, without "
                                 "--weight-only: weight-only schemes keep their activations in 16 bits)")
            self.smoothquant_alpha = _alpha(self.smoothquant_alpha)
        elif self.method == "int8" and not self.weight_only:
            self.smoothquant_alpha = "auto"
        if self.device not in DEVICES and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.needs_calibration and ((self.num_samples is not None and self.num_samples < 1) or
                                       (self.seq_len is not None and self.seq_len < 2)):
            raise ValueError(f"need --num-samples >= 1 and --seq-len >= 2, got {self.num_samples} and {self.seq_len}")
        out = Path(self.output_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--output-dir {str(out)!r} is a file")
        if out.exists() and any(out.iterdir()) and not self.overwrite:
            raise ValueError(f"--output-dir {str(out)!r} is not empty (pass --overwrite to replace it)")

    def fill_calibration(self, device_type: str) -> str | None:
        """Fill the calibration size left unset with the device's default; on a CPU, the line that says so."""
        samples, seq_len = CALIBRATION_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
        defaulted = self.num_samples is None or self.seq_len is None
        self.num_samples = samples if self.num_samples is None else self.num_samples
        self.seq_len = seq_len if self.seq_len is None else self.seq_len
        if not defaulted or device_type == "cuda" or not self.needs_calibration:
            return None
        gpu = CALIBRATION_DEFAULTS["cuda"]
        return (f"CPU: {self.num_samples} x {self.seq_len} calibration tokens (override with --num-samples/--seq-len; "
                f"{gpu[0]} x {gpu[1]} on a GPU)")

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("awq", "gptq") or self.gptq or self.smoothquant_alpha is not None or (
            self.method == "int8" and not self.weight_only)

    @property
    def layout(self) -> str:
        """awq (AutoAWQ GEMM), gptq, or ct (compressed-tensors)."""
        if self.method in ("fp8", "int8"):
            return "ct"
        return "awq" if self.method == "awq" or (self.method == "rtn" and self.bits == 4) else "gptq"

    @property
    def scheme(self) -> str:
        if self.method in ("awq", "gptq", "rtn"):
            name = {"awq": "AutoAWQ GEMM", "gptq": "GPTQ"}[self.layout]
            extra = f", {'sym' if self.sym else 'asym'}{', desc_act' if self.desc_act else ''}" \
                if self.method == "gptq" else ""
            return f"{self.method.upper()} W{self.bits}A16 g{self.group_size}, {name}{extra}"
        rounding = f", GPTQ rounding{', desc_act' if self.desc_act else ''}" if self.gptq else ""
        if self.weight_only:
            return f"{self.method.upper()} W8A16{rounding}, compressed-tensors"
        alpha = self.smoothquant_alpha
        smooth = "" if alpha is None else f" SmoothQuant alpha {alpha if alpha == 'auto' else format(alpha, 'g')}"
        return f"{self.method.upper()} W8A8{smooth}{rounding}, dynamic per-token activations, compressed-tensors"

    @property
    def dtype_name(self) -> str:
        """Tensors left in float: float16 beside AWQ/GPTQ (their kernels are fp16), bfloat16 beside
        compressed-tensors (llm-compressor's usual)."""
        return "bfloat16" if self.layout == "ct" else "float16"

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def quantization_config(self) -> dict:
        if self.layout == "awq":
            return checkpoint.awq_config(self.group_size)
        if self.layout == "gptq":
            return checkpoint.gptq_config(self.bits, self.group_size, self.sym, self.desc_act)
        return checkpoint.compressed_tensors_config(self.method, self.weight_only)

    def check_shapes(self, model) -> None:
        """Every quantized linear's input size must be a multiple of the group size (and of the packing)."""
        from vserve.quantize.layers import LINEARS, decoder_layers

        _, layers = decoder_layers(model)
        ins = sorted({layers[0].get_submodule(n).in_features for n in LINEARS})
        outs = sorted({layers[0].get_submodule(n).out_features for n in LINEARS})
        if self.method in ("awq", "gptq", "rtn") and any(n % self.group_size for n in ins):
            raise ValueError(f"--group-size {self.group_size} must divide every linear's input size "
                             f"({', '.join(map(str, ins))}); try --group-size 64 or 32")
        if self.layout == "awq" and any(n % 8 for n in outs):
            raise ValueError(f"the AutoAWQ GEMM layout packs 8 output channels per int32; output sizes are {outs}")
        per = {"gptq": 32 // self.bits, "ct": 4 if self.weight_only else 1}.get(self.layout, 1)
        if any(n % per for n in ins):
            raise ValueError(f"packing {per} values per int32 needs input sizes divisible by {per}: {ins}")


def _alpha(value: float | str) -> float | str:
    """--smoothquant-alpha as given: "auto", or a number in [0, 1]."""
    if value == "auto":
        return value
    try:
        alpha = float(value)
    except ValueError:
        raise ValueError(f"--smoothquant-alpha must be a number in [0, 1] or auto, got {value!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--smoothquant-alpha must be in [0, 1], got {value}")
    return alpha
