"""Mixtral-style MoE: the fused Triton kernel matches its reference; greedy tokens match HF, under TP=2 and PP=2."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from vserve import LLM, SamplingParams  # noqa: E402
from vserve.kernels.moe_ref import fused_moe_ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k"), [(5, 48, 40, 4, 2), (3, 32, 96, 3, 1)])
def test_fused_moe_kernel_matches_reference(dtype, T, H, inter, E, k):
    from vserve.kernels.triton_moe import fused_moe

    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    x = torch.randn(T, H, dtype=dtype, device=DEVICE)
    w13 = (torch.randn(E, 2 * inter, H, device=DEVICE) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device=DEVICE) / inter ** 0.5).to(dtype)
    weights, ids = torch.softmax(torch.randn(T, E, device=DEVICE), -1).topk(k, dim=-1)
    got = fused_moe(x, w13, w2, weights / weights.sum(-1, keepdim=True), ids, block_n=16, block_k=16)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(got, want.to(dtype), **TOL[dtype], msg=lambda m: f"{m}\n(seed {seed})")


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_mixtral_greedy_tokens_match_hf_under_tp2_and_pp2(tiny_mixtral, hf_greedy):

    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    expected = hf_greedy(tiny_mixtral, prompts, 16)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(str(tiny_mixtral), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, f"tp={tp} pp={pp}"
