"""Training drafts for a target: self-distillation data, distilled draft models, EAGLE and Medusa heads."""

from pathlib import Path

# the command writing each kind's training data: `train magpie` (self-generated conversations, .npz shards) or
# `train data` (the target's answers to training prompts, .jsonl shards)
DATA_COMMAND = {"eagle3": "magpie", "exit": "magpie", "draft": "data", "eagle": "data", "medusa": "data"}


def magpie_dir(given: str | None, model: str) -> Path:
    """A shard directory as given on the command line; else data/MODEL of the source tree specdec runs from (the
    shards shipped in the repository) where that exists, else data/MODEL under the working directory."""
    if given:
        return Path(given)
    tree = Path(__file__).resolve().parents[3] / "data"
    return (tree if tree.is_dir() else Path("data")) / model


def data_dir(given: str | None, model: str) -> Path:
    """`train data`'s shard directory: as given, else runs/data/MODEL under the working directory."""
    return Path(given or f"runs/data/{model}")


def has_default_data(model: str, kind: str) -> bool:
    """Whether the default data directory of `kind` (see DATA_COMMAND) holds shards for `model`."""
    if DATA_COMMAND[kind] == "magpie":
        from .magpie import shard_files

        return bool(shard_files(magpie_dir(None, model)))
    return any(data_dir(None, model).glob("shard-*.jsonl"))
