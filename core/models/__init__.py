"""Model implementations, chosen by `architectures` in config.json."""

from vserve.core.model_config import SUPPORTED_ARCHITECTURES, ModelConfig


def get_model_class(config: ModelConfig):
    from vserve.core.models.cohere import CohereForCausalLM
    from vserve.core.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vserve.core.models.gemma import GemmaForCausalLM
    from vserve.core.models.llama import LlamaForCausalLM
    from vserve.core.models.phi3 import Phi3ForCausalLM
    from vserve.core.models.qwen_moe import QwenMoeForCausalLM
    from vserve.core.models.starcoder2 import Starcoder2ForCausalLM

    families = {"llama": LlamaForCausalLM, "gemma": GemmaForCausalLM, "phi3": Phi3ForCausalLM,
                "cohere": CohereForCausalLM, "starcoder2": Starcoder2ForCausalLM, "qwen_moe": QwenMoeForCausalLM,
                "deepseek_v2": DeepseekV2ForCausalLM}
    return families[SUPPORTED_ARCHITECTURES[config.architecture]]
