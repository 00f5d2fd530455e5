"""Model implementations, chosen by `architectures` in config.json."""

from vserve.core.model_config import SUPPORTED_ARCHITECTURES, ModelConfig


def get_model_class(config: ModelConfig):
    from vserve.core.models.llama import LlamaForCausalLM

    families = {"llama": LlamaForCausalLM}
    return families[SUPPORTED_ARCHITECTURES[config.architecture]]
