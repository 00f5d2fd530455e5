"""A checkpoint AutoAWQ itself wrote (tests/fixtures/make_autoawq_fixture.py: AutoAWQ 0.2.9 on CPU, a tiny random
Llama): vserve reads its layout bit for bit as AutoAWQ does, writes the same config, and serves it."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vserve.quantize.checkpoint import awq_config
from vserve.quantize.formats import dequantize_awq

FIXTURE = Path(__file__).parent / "fixtures" / "autoawq_tiny"
DEQUANT = Path(__file__).parent / "fixtures" / "autoawq_tiny_dequantized.safetensors"


def test_dequantize_awq_matches_autoawq_dequantize_gemm_exactly():
    tensors, expected = load_file(str(FIXTURE / "model.safetensors")), load_file(str(DEQUANT))
    assert len(expected) == 14  # 2 layers x q, k, v, o, gate, up, down
    for name, ref in expected.items():
        p = name.removesuffix(".weight")
        w = dequantize_awq(tensors[p + ".qweight"], tensors[p + ".qzeros"], tensors[p + ".scales"], group_size=64)
        # AutoAWQ computes (q - z) * s in fp16; the same product is exact in fp32, so one rounding gives the same.
        assert ref.dtype == torch.float16 and w.shape == ref.shape
        assert torch.equal(w.half(), ref), name


def test_vserve_writes_the_quantization_config_autoawq_writes():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["quantization_config"] == awq_config(64)


@pytest.mark.skipif(importlib.util.find_spec("vserve.core.layers.quantization") is None,
                    reason="serving quantized checkpoints (core/layers/quantization.py) is not in this tree yet")
def test_autoawq_checkpoint_loads_in_vserve_and_generates_as_its_dequantized_weights(tmp_path):
    from vserve import LLM, SamplingParams
    from vserve.quantize.emulate import load_fake_quantized

    prompt = [5, 17, 99, 123, 42, 7]
    model = load_fake_quantized(FIXTURE)  # the float model holding AutoAWQ's dequantized weights
    for p, w in load_file(str(DEQUANT)).items():
        assert torch.equal(model.get_parameter(p).half(), w)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    llm = LLM(str(FIXTURE), dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=64,
              num_kv_blocks=8)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[0, len(prompt):].tolist()
