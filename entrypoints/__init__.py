"""vLLM's module entry points (`python -m vllm.entrypoints.api_server ...`) under vserve's name: the same servers."""
