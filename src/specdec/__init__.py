"""specdec: lossless speculative decoding for LLMs.

`import specdec` is light: torch and the models load on first use of `specdec.load`, `Generator`, ...
(module attributes resolved lazily), so the command line answers `--help` at once."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import SpecdecError
from .machine import apply_isa_limit
from .names import METHODS

apply_isa_limit()          # $SPECDEC_ISA, before torch computes anything

if TYPE_CHECKING:
    from .api import Generator, Result, load, load_model
    from .logprobs import TokenLogprob
    from .sampling import SamplingParams

_LAZY = {"load": "api", "load_model": "api", "Generator": "api", "Result": "api", "SamplingParams": "sampling",
         "TokenLogprob": "logprobs"}

__all__ = ["load", "load_model", "Generator", "Result", "SamplingParams", "TokenLogprob", "SpecdecError", "METHODS",
           "__version__"]


def version() -> str:
    """The installed distribution's version, else the one in the source tree's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"


def __getattr__(name: str) -> object:
    """`specdec.load` and friends, imported (with torch) on first access; `__version__` looked up once."""
    if name == "__version__":
        value: object = version()
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (and the dunders), not this module's helpers."""
    return sorted({*__all__, "version", *(n for n in globals() if n.startswith("__") and n.endswith("__"))})
