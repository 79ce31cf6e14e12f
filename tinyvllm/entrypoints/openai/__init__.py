"""The OpenAI-compatible server: protocol, serving handlers, metrics, the FastAPI app."""
