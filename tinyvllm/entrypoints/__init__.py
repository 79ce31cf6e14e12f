"""How users reach the engine from outside Python: the `tinyvllm` command, the OpenAI-compatible server."""
