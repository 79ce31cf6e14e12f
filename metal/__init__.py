"""The Metal shaders, installed as the package `tinyvllm.shaders` so they ship inside wheels."""
