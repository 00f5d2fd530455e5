"""`python -m vserve.entrypoints.openai.api_server --model M [engine flags]`: vLLM's OpenAI server entry point, the
same server as `vserve serve`."""

from __future__ import annotations

from vserve.entrypoints.api_server import main

if __name__ == "__main__":
    main()
