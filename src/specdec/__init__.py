"""specdec: lossless speculative decoding for LLMs."""
from .machine import apply_isa_limit

apply_isa_limit()          # $SPECDEC_ISA, before torch computes anything

from .api import METHODS, Generator, Result, load  # noqa: E402
from .errors import SpecdecError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["load", "Generator", "Result", "SamplingParams", "SpecdecError", "METHODS"]
