"""`vserve quantize --backend autoawq`: the same calibration samples handed to AutoAWQ itself (when it is
installed), for a cross-check of the native AWQ; AutoAWQ writes the folder, vserve adds the tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

from vserve.quantize import checkpoint
from vserve.quantize.options import QuantizeOptions

INSTALL_HINT = ("--backend autoawq needs AutoAWQ, which is deprecated and pins transformers 4.51: install it in a "
                "separate environment (pip install torch transformers==4.51.3 accelerate datasets zstandard; "
                "pip install --no-deps autoawq==0.2.9) or use --backend native")


def _cpu_safe_quantizer():
    """AutoAWQ's quantizer with one fix for CPU runs: its scale search saves the block's weights as
    `{k: v.cpu() ...}`, a copy on a GPU but the same tensors on CPU, then scales the weights in place; on CPU every
    grid point so starts from the previous one's scaled weights and the search returns garbage (perplexity in
    the 100,000s on SmolLM2). Saving clones instead restores the original weights at every grid point."""
    from awq.quantize.quantizer import AwqQuantizer

    class CPUSafeAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs=None):
            state_dict = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in state_dict(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale, fp16_output,
                                                   kwargs or {})
            finally:
                del module2inspect.state_dict  # the instance attribute shadowed the method

    return CPUSafeAwqQuantizer


def quantize_with_autoawq(folder: Path, opts: QuantizeOptions) -> int:
    """Quantize folder into opts.output_dir with AutoAWQ (float32 on CPU, GEMM); returns the samples used."""
    try:
        import torch
        from awq import AutoAWQForCausalLM
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    from vserve.quantize.calibration import calibration_samples, calibration_token_ids

    ids = calibration_token_ids(folder, opts.calib_data)
    samples = calibration_samples(ids, opts.num_samples, opts.seq_len, opts.seed).tolist()
    model = AutoAWQForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    # Token-id samples of exactly seq_len: AutoAWQ concatenates and re-splits them into the same blocks.
    model.quantize(None, quant_config={"zero_point": True, "q_group_size": opts.group_size, "w_bit": 4,
                                       "version": "GEMM"},
                   calib_data=samples, max_calib_samples=len(samples), max_calib_seq_len=opts.seq_len,
                   n_parallel_calib_samples=8, quantizer_cls=_cpu_safe_quantizer())
    tmp = Path(str(opts.output_dir) + ".autoawq-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_quantized(str(tmp))
    for name in checkpoint.TOKENIZER_FILES:
        if (folder / name).is_file() and not (tmp / name).exists():
            shutil.copy(folder / name, tmp / name)
    shutil.rmtree(opts.output_dir, ignore_errors=True)
    tmp.rename(opts.output_dir)
    return len(samples)
