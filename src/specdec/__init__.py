"""specdec: lossless speculative decoding for LLMs."""
from .api import METHODS, Generator, Result, load
from .errors import SpecdecError
from .sampling import SamplingParams

__all__ = ["load", "Generator", "Result", "SamplingParams", "SpecdecError", "METHODS"]
