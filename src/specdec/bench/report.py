"""Benchmark report: results.json, report.md (Spec-Bench-like tables) and PNG plots."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..errors import SpecdecError

RESULTS = "results.json"
REPORT = "report.md"
SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance.png"
BASELINE = "none"


# --------------------------------------------------------------------------- formatting


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _columns(results: dict) -> list[str]:
    return [*results["config"]["categories"], "overall"]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _equality(cell: dict, name: str, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampling)"
    if name == BASELINE:
        return "reference"
    same = cell["runs"] - cell["mismatches"]
    return f"{same}/{cell['runs']} ✓" if cell["equal"] else f"**{same}/{cell['runs']} FAIL**"


# --------------------------------------------------------------------------- sections


def sampling_mode(c: dict, temperature: str) -> str:
    """"greedy", or the temperature (named as `temperature` says) with the top-p and top-k a run set."""
    if c["greedy"]:
        return "greedy"
    cuts = [f"top-p {c['top_p']}" if c.get("top_p", 1.0) < 1 else "", f"top-k {c['top_k']}" if c.get("top_k") else ""]
    return ", ".join([f"{temperature}{c['temperature']}", *filter(None, cuts)])


def _heading(results: dict) -> list[str]:
    c = results["config"]
    mode = sampling_mode(c, "temperature ")
    draft = f", draft `{c['draft_model']}`" if c.get("draft_model") else ""
    isa = (c.get("runtime") or {}).get("isa_limit")
    dtype = f"{c['dtype']} (kernels limited to {isa} by SPECDEC_ISA)" if isa else c["dtype"]
    return [
        f"# specdec benchmark: {c['model']}, {c['suite']} suite",
        "",
        f"{len(results['prompts'])} prompts ({', '.join(c['categories'])}), "
        f"{c['repeats']} repeat{'s' * (c['repeats'] != 1)}, "
        f"{dtype}, {mode}, batch 1, chat template {'on' if c['chat_template'] else 'off'}, "
        f"K={c['num_draft_tokens']} ({c['draft_policy']} policy){draft}. "
        f"Measured {results['machine']['date']}, {results['elapsed_seconds'] / 60:.1f} min.",
        *(["", f"**Interrupted**: {results['generations']['ran']} of {results['generations']['planned']} "
               "generations ran; this report covers the prompts every system finished."]
          if results.get("interrupted") else []),
    ]


def _speedup_table(results: dict) -> list[str]:
    cols = _columns(results)
    rows = []
    for name, cells in results["summary"]["methods"].items():
        rows.append([f"`{name}`", *(f"{_times(cells[c]['speedup'])} ({_num(cells[c]['tau'])})" for c in cols)])
    return [
        "## Speedup over `none` (tau)", "",
        *_table(["method", *cols], rows), "",
        "Speedup: median over prompts and repeats of tokens/s(method) / tokens/s(`none`), each pair measured "
        "back to back in the same repeat. tau: new tokens per target forward (total over all runs).",
    ]


def summary_table(results: dict) -> str:
    """The speedup (tau) table alone, for the terminal."""
    return "\n".join(_speedup_table(results)[2:-2])


def _detail_table(results: dict) -> list[str]:
    greedy = results["config"]["greedy"]
    methods = results["summary"]["methods"]
    predicted = any(cells["overall"].get("prediction_drafts") for cells in methods.values())
    rows = []
    for name, cells in methods.items():
        cell = cells["overall"]
        per = " ".join(f"{x:.2f}" for x in cell["acceptance_per_position"]) or "–"
        share = cell.get("draft_share")
        pred = [_num(cell.get("prediction_acceptance"))] if predicted else []
        rows.append([f"`{name}`", _num(cell["tokens_per_second"], 1), _times(cell["speedup"]),
                     _times(cell["speedup_total"]), _num(cell["tau"]), _num(cell["acceptance_rate"]), per, *pred,
                     "–" if share is None else f"{100 * share:.0f}%", _equality(cell, name, greedy)])
    header = ["method", "tokens/s (median)", "speedup (median)", "speedup (summed time)", "tau",
              "acceptance rate", "acceptance per position", *(["prediction drafts accepted"] if predicted else []),
              "time proposing", "output = `none`"]
    note = (" Acceptance counts the method's own drafts; the drafts a step takes from a request's prediction "
            "(the `edit` category) are counted apart (prediction drafts accepted); tau counts every token."
            if predicted else "")
    return ["## Throughput, acceptance, equality (all categories)", "", *_table(header, rows), "",
            "Time proposing: the share of the generation time (summed over runs) spent outside the target's "
            "forwards and verification: drafting, and the proposer's and the engine's bookkeeping of each step "
            "(for `none`, that bookkeeping alone)." + note]


def _tps_table(results: dict) -> list[str]:
    cols = _columns(results)
    rows = [[f"`{name}`", *(_num(cells[c]["tokens_per_second"], 1) for c in cols)]
            for name, cells in results["summary"]["methods"].items()]
    return ["## tokens/s per category (median)", "", *_table(["method", *cols], rows)]


def _peers_table(results: dict) -> list[str]:
    peers = results["summary"]["peers"]
    notes = results["config"].get("peer_notes") or []
    if not peers and not notes:
        return []
    methods = list(results["summary"]["methods"])
    rows = []
    for name, cells in peers.items():
        cell = cells["overall"]
        desc = results["peer_descriptions"].get(name, name)
        rows.append([f"`{name}`: {desc}", _num(cell["tokens_per_second"], 1),
                     f"{cell['same_output']}/{cell['runs']}",
                     *(_times(cell["speedup_of"].get(m)) for m in methods)])
    header = ["peer", "tokens/s (median)", "output = our `none`", *(f"`{m}` speedup" for m in methods)]
    lines = ["## Peers (same prompts and lengths, greedy, interleaved with ours)", ""]
    if rows:
        lines += _table(header, rows) + [
            "", "Our speedup over a peer: median over prompts and repeats of tokens/s(ours) / tokens/s(peer). "
            "Output agreement is informational (different kernels and dtypes may break near-ties)."]
    return lines + [f"- {note}" for note in notes]


def _yardstick_table(results: dict) -> list[str]:
    """Every method's speedup over the faster of the plain-decoding peers (llama.cpp's two ways)."""
    yard = results["summary"].get("yardstick") or {}
    if not yard:
        return []
    fastest, speed = yard["fastest"], yard["tokens_per_second"]
    cols = _columns(results)
    cells = results["summary"]["peers"][fastest]
    rows = [[f"`{name}`", *(_times(cells[c]["speedup_of"].get(name)) for c in cols)]
            for name in results["summary"]["methods"]]
    measured = ", ".join(f"`{n}` {_num(speed[n], 1)}" for n in yard["peers"])
    lines = [f"## Speedup over `{fastest}`, the fastest plain peer", "",
             f"Plain decoding peers, median tokens/s: {measured}.", "", *_table(["method", *cols], rows), "",
             f"Speedup: median over prompts and repeats of tokens/s(method) / tokens/s(`{fastest}`), each pair "
             "measured back to back in the same repeat."]
    if len(yard["peers"]) > 1:
        lines.append(f"{' and '.join(f'`{n}`' for n in yard['peers'])} gave the same tokens on "
                     f"{yard['same_output']}/{yard['runs']} runs.")
    return lines


def _failures(results: dict) -> list[str]:
    eq = results["summary"]["equality"]
    lines: list[str] = []
    if eq["checked"] and eq["failures"]:
        lines += ["## Equality FAILURES", "", f"{eq['failures']} runs differ from `none`:"]
        lines += [f"- `{m['system']}` on `{m['prompt_id']}` (repeat {m['repeat'] + 1}): first difference at turn "
                  f"{m['turn'] + 1}, token {m['index']} (lengths {m['lengths'][0]} vs {m['lengths'][1]})"
                  for m in eq["mismatches"]]
    if eq.get("nondeterministic"):
        lines += ["", "Outputs that changed between repeats: "
                  + ", ".join(f"`{m['system']}` {m['prompt_id']} (repeat {m['repeat'] + 1})"
                              for m in eq["nondeterministic"])]
    return lines


def _machine(results: dict) -> list[str]:
    m = results["machine"]
    load = m.get("load_average")
    load_text = f", load average at start {load[0]:.1f}" if load else ""
    load_text += "".join(f", {k}={v}" for k, v in (m.get("env") or {}).items())
    return [
        "## Machine", "",
        f"{m['cpu']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads{load_text}; torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; dtype {m['dtype']}; {m['date']}"
        + (f"; specdec commit {m['git_commit']}" if m.get("git_commit") else ""),
    ]


def markdown(results: dict) -> str:
    """The whole report.md text."""
    sections = [_heading(results), _speedup_table(results), _detail_table(results), _tps_table(results),
                _peers_table(results), _yardstick_table(results), _failures(results), _machine(results),
                ["## Command", "", "```bash", results["command"], "```"]]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"


# --------------------------------------------------------------------------- plots


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SpecdecError("the benchmark plots need matplotlib; install it with: pip install 'specdec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(plt, n: int) -> list:
    """n distinct colours: matplotlib's default cycle repeats after 10 methods."""
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _title(results: dict, what: str) -> str:
    c = results["config"]
    mode = sampling_mode(c, "T=")
    return f"{what} - {c['model']}, {c['suite']} suite, {c['dtype']}, {mode}"


def plot_speedup(results: dict, path: Path) -> None:
    """Grouped bars: speedup over `none` per category (and overall) for every other method."""
    plt = _pyplot()
    cols = _columns(results)
    methods = {n: c for n, c in results["summary"]["methods"].items() if n != BASELINE}
    fig, ax = plt.subplots(figsize=(max(7.0, 0.16 * len(cols) * max(1, len(methods)) + 3.5), 4.8))
    width = 0.8 / max(1, len(methods))
    colors = _colors(plt, len(methods))
    for i, (name, cells) in enumerate(methods.items()):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cols))]
        ys = [cells[c]["speedup"] or 0.0 for c in cols]
        bars = ax.bar(xs, ys, width, label=name, color=colors[i])
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, padding=1, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="none (1.0)")
    ax.set_xticks(range(len(cols)), cols, rotation=20)
    ax.set_ylabel("speedup over none (tokens/s ratio)")
    ax.set_title(_title(results, "Speedup"), fontsize=10)
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(results: dict, path: Path) -> None:
    """Acceptance rate per draft position (all categories) for every drafting method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = 0
    methods = {n: c for n, c in results["summary"]["methods"].items() if n != BASELINE}
    colors = _colors(plt, len(methods))
    for i, (name, cells) in enumerate(methods.items()):
        rates = cells["overall"]["acceptance_per_position"]
        if not rates:
            continue
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name, color=colors[i])
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no drafting method", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at position i")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.set_title(_title(results, "Acceptance per draft position"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- all


def write_report(results: dict, out: Path) -> list[Path]:
    """results.json, report.md, speedup.png and acceptance.png into ``out``; returns their paths. Where they
    cannot be written there (a full disk, a file that cannot be replaced) they go to a new temporary folder and
    a one-line error says where: a finished run is never lost."""
    import tempfile

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        return _write(results, out)
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
        _write(results, fallback)
        raise SpecdecError(f"cannot write the report into {out} ({e.strerror or e}); it went to {fallback}") from None


def report_files(out: Path) -> list[Path]:
    """The files `write_report` writes into `out`."""
    return [out / RESULTS, out / REPORT, out / SPEEDUP_PNG, out / ACCEPTANCE_PNG]


def _write(results: dict, out: Path) -> list[Path]:
    paths = report_files(out)
    paths[0].write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(results), encoding="utf-8")
    plot_speedup(results, paths[2])
    plot_acceptance(results, paths[3])
    return paths
