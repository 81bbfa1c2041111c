"""The learning curve of a `specdec train eagle3` run: validation top-1 agreement against training tokens seen.

    .venv/bin/python benchmarks/plot_learning_curve.py runs/eagle3-full/head.curve.jsonl --out curve.png

Reads OUT.curve.jsonl (one line per progress report: tokens, step, agreement per category and draft
position, and their mean) and draws one panel per draft position: the mean over categories (thick) and
each category (thin). Prints the last line's figures.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_curve(path: Path) -> list[dict]:
    """The curve's points in the order they were written."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(points: list[dict], out: Path, title: str) -> None:
    """One panel per draft position: agreement against tokens seen (millions)."""
    depths = len(points[0]["mean"])
    cats = sorted(points[-1]["agreement"])
    x = [p["tokens"] / 1e6 for p in points]
    fig, axes = plt.subplots(1, depths, figsize=(4 * depths, 3.6), sharey=True, squeeze=False)
    for d, ax in enumerate(axes[0]):
        for c in cats:
            ax.plot(x, [p["agreement"].get(c, [float("nan")] * depths)[d] for p in points], lw=0.8, label=c)
        ax.plot(x, [p["mean"][d] for p in points], lw=2.5, color="black", label="mean")
        ax.set_title(f"draft position {d + 1}")
        ax.set_xlabel("training tokens seen (M)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation top-1 agreement")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("curve", help="OUT.curve.jsonl of a train eagle3 run")
    ap.add_argument("--out", default=None, help="PNG to write (default: beside the curve)")
    a = ap.parse_args()
    path = Path(a.curve)
    points = read_curve(path)
    if not points:
        raise SystemExit(f"{path}: no points yet (the first comes after --report-minutes of training)")
    out = Path(a.out) if a.out else path.with_suffix(".png")
    plot(points, out, path.parent.name)
    last = points[-1]
    print(f"{len(points)} points; last: step {last['step']}, {last['tokens']} tokens, mean agreement per "
          f"position {last['mean']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
