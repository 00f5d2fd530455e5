"""The memory planner and `vserve doctor` know the new families' shapes: the planner's parameter count is the one
the built model has (every norm, bias and head layout), and doctor plans the published shapes."""

from dataclasses import replace

import pytest
import torch
from test_doctor import HEALTHY

from vserve.core.memory import num_params, weights_bytes
from vserve.core.model_config import ModelConfig
from vserve.core.models import get_model_class
from vserve.ops.doctor import run_doctor
from vserve.ops.model_shapes import KNOWN_SHAPES, known_shape

NEW_SHAPES = ["gemma-7b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b", "phi-3-mini", "phi-3-medium", "phi-4-mini",
              "command-r-35b", "command-r7b", "starcoder2-15b", "deepseek-llm-7b"]


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_planned_parameters_are_the_built_models(name):
    """Two layers of the published shape (and Command R+'s per-head q/k norms), built on the meta device."""
    cfg = {**KNOWN_SHAPES[name], "num_hidden_layers": 2, "vocab_size": 1000,
           "use_qk_norm": name == "command-r-35b"}
    m = ModelConfig.from_dict(cfg)
    with torch.device("meta"):
        model = get_model_class(m)(m)
    assert sum(p.numel() for p in model.parameters()) == num_params(m)


@pytest.mark.parametrize("name,billions", [("gemma-2-9b", 9.24), ("gemma-2-27b", 27.2), ("phi-3-mini", 3.82),
                                           ("phi-3-medium", 13.96), ("command-r-35b", 35.0),
                                           ("starcoder2-15b", 15.7)])
def test_published_sizes(name, billions):
    assert num_params(known_shape(name)) / 1e9 == pytest.approx(billions, rel=0.02)


def test_doctor_plans_the_new_families_on_an_h100():
    gemma = run_doctor(HEALTHY, model="gemma-2-9b", max_model_len=8192)
    assert gemma.plan.fits and gemma.plan.weights_bytes == weights_bytes(known_shape("gemma-2-9b"), 2)
    command_r = run_doctor(replace(HEALTHY, gpus=HEALTHY.gpus[:1]), model="command-r-35b", max_model_len=8192)
    assert command_r.plan.weights_bytes > 64 * 2**30  # 35B in bf16: an 80 GB GPU is left little KV cache
    phi = run_doctor(HEALTHY, model="phi-3-mini")
    assert phi.plan.max_model_len == 4096  # no longer capped at its 2,047-token window
