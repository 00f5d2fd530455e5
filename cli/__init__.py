"""The `vserve` command line: thin typer commands over the public API (`LLM`, `SamplingParams`, `EngineConfig`)."""
