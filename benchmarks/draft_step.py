"""What one drafting step of the shipped EAGLE-3 head costs on this machine, against a target forward.

A step feeds one token (and its feature) through the head's decoder layer after a context of `--context`
committed pairs, then turns the output into draft logits; a chain of K drafts pays K - 1 layer forwards and
K logits. Prints the medians of interleaved calls (ms): the step's parts, the proposer's whole chain of
`--chain` drafts (no confidence cut), a plain target forward (1 row, LM head included) for scale, and, with
`--profile`, the ATen ops of a step by self time.

    .venv/bin/python benchmarks/draft_step.py --threads 1
    .venv/bin/python benchmarks/draft_step.py --threads 1 --profile
    .venv/bin/python benchmarks/draft_step.py --threads 1 --head runs/eagle3/head.safetensors   # another head
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import specdec  # noqa: F401  (applies $SPECDEC_ISA before torch computes)
import torch

from specdec.api import load_model, shipped
from specdec.machine import cpu_model, probe
from specdec.models.eagle3 import Eagle3Head
from specdec.proposers.base import ActiveBatch
from specdec.proposers.eagle import EagleProposer
from specdec.sampling import BatchSampling, SamplingParams


def medians(calls: dict[str, Callable[[], object]], repeats: int, block: int = 10) -> dict[str, float]:
    """Median over `repeats` of the mean ms per call in a block of `block` back-to-back calls, the blocks of
    the calls interleaved so that a busy machine slows each alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            for _ in range(block):
                call()
            times[name].append((time.perf_counter() - t) / block)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="q4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200, help="committed pairs in the head's cache")
    ap.add_argument("--repeats", type=int, default=30, help="blocks of 10 calls each")
    ap.add_argument("--head", default="", help="an EAGLE-3 head file (default: the shipped one)")
    ap.add_argument("--chain", type=int, default=4, help="drafts of the proposer's chain (default: %(default)s)")
    ap.add_argument("--profile", action="store_true", help="also list a step's ATen ops by self time")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_model(a.model, a.dtype)[0]
    head = Eagle3Head.load(Path(a.head) if a.head else shipped(target.config.name, "eagle3"), target)
    m = probe()
    print(f"{a.model} {a.dtype}, EAGLE-3 head ({head.cfg.hidden_dim}-wide MLP, {head.cfg.draft_vocab}-token draft "
          f"vocabulary, {head.fc.weight.dtype}), {a.threads} thread(s), context {a.context}")
    print(f"CPU: {cpu_model()}, torch {torch.__version__} kernels {m.torch_capability}")
    print("linears: " + ", ".join(f"{n} {getattr(k, 'label', type(k).__name__)}" for n, k in head.packed.items()))
    H, C = head.cfg.dim, a.context
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, C + 1, H, generator=gen).to(head.fc.weight.dtype)             # [1, C+1, H]
    toks = torch.randint(0, target.vocab_size, (1, C + 1), generator=gen)                  # [1, C+1]
    rows = torch.tensor([0])
    cache = head.new_cache(1, C + 8)
    tcache = target.new_cache(1, C + 8)
    with torch.inference_mode():
        head(toks[:, :C], feats[:, :C], torch.arange(C)[None], cache, rows)
        cache.commit(rows, torch.arange(C)[None], torch.tensor([C]))
        target(toks[:, :C], torch.arange(C)[None], tcache, rows)
        tcache.commit(rows, torch.arange(C)[None], torch.tensor([C]))
        one, at = toks[:, C:], torch.tensor([[C]])

        def layer() -> object:
            return head(one, feats[:, C:], at, cache, rows)            # scratch slot: written, not committed

        def logits() -> object:
            return head.logits(feats[:, C])

        def step() -> object:
            return head.logits(head(one, feats[:, C:], at, cache, rows)[:, -1]).argmax(-1)

        def target_forward() -> object:
            return target.lm_head(target(one, at, tcache, rows)).argmax(-1)

        prop = EagleProposer(head, 1, a.chain, a.chain, name="eagle3")              # chain, no confidence cut
        prop.allocate(1, C + 8)
        prompt = toks[0, :C + 1].tolist()
        prop.start(rows, [prompt], torch.randn(1, C, 4 * H, generator=gen))          # the target's features [1, C, 4H]
        batch = ActiveBatch(rows, [prompt], BatchSampling.of([SamplingParams()]), torch.zeros(1, dtype=torch.long))
        prop.propose(batch, a.chain)                                                  # the prompt's catch-up

        def chain() -> object:
            return prop.propose(batch, a.chain)

        calls = {"head layer": layer, "head logits": logits, "drafting step (layer + logits + argmax)": step,
                 f"proposer's chain of {a.chain} drafts": chain, "target forward (1 row, LM head, argmax)": target_forward}
        medians(calls, 2)
        for name, ms in medians(calls, a.repeats).items():
            print(f"  {name:42s} {ms:7.3f} ms")
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
