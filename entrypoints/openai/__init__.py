"""vLLM's `vllm.entrypoints.openai` path."""
