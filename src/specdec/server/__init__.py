"""An OpenAI-compatible HTTP server with speculative decoding and continuous batching (`specdec serve`)."""
from .app import ServeConfig, ServerState, create_app

__all__ = ["ServeConfig", "ServerState", "create_app"]
