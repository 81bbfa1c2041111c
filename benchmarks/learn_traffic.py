"""Learning from traffic: a repeated workload served by `specdec serve --learn`, acceptance per pass.

The first prompt of each mini-suite category (first turn, greedy, `--tokens` tokens), sent together as
requests of `--method` (eagle3 or hybrid, the methods drafting with the EAGLE-3 head), `--passes` times. Between passes the server is left
idle until it has spent its training budget (the gauge specdec:learn_pending_tokens reaches 0), so each
pass drafts with what the previous ones taught the head. Per pass: first-draft acceptance (from the
server's counters), acceptance per draft position (mean over requests), tokens per target forward, and
whether every output equals pass 1's. Then the server is stopped (it writes the learnt head) and, with
--restart, started again on the same checkpoint for one more pass.

    OMP_NUM_THREADS=1 python benchmarks/learn_traffic.py --passes 5 --tokens 64 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from specdec.bench.suites import CATEGORIES, load_suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class Server:
    """`specdec serve --learn` in a subprocess (its stderr goes to ours)."""

    def __init__(self, a: argparse.Namespace, checkpoint: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "from specdec.cli import main; raise SystemExit(main())", "serve", "--model", a.model, "--method", a.method, "--draft-policy",
               "fixed", "--num-draft-tokens", str(a.k), "--threads", str(a.threads), "--prefill-threads",
               str(a.threads), "--port", str(self.port), "--max-tokens", str(a.tokens), "--learn",
               "--learn-checkpoint", str(checkpoint)]
        self.cmd = " ".join(cmd[3:])
        self.proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
        deadline = time.monotonic() + 600
        while True:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(120)


def one(url: str, model: str, method: str, text: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0, "speculative": {"method": method}}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=1200)
    r.raise_for_status()
    return r.json()


def run_pass(srv: Server, a: argparse.Namespace, texts: list[str]) -> dict:
    before = srv.metrics()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        out = list(pool.map(lambda t: one(srv.url, a.model, a.method, t, a.tokens), texts))
    seconds = time.perf_counter() - t0
    after = srv.metrics()

    def delta(name: str, labels: str = "") -> float:
        return metric(after, name, labels) - metric(before, name, labels)

    spec = [o["speculative"] for o in out]
    per_pos = [sum(s["acceptance_per_position"][i] for s in spec if len(s["acceptance_per_position"]) > i)
               / max(1, sum(len(s["acceptance_per_position"]) > i for s in spec)) for i in range(a.k)]
    return {"texts": [o["choices"][0]["message"]["content"] for o in out],
            "first_draft_acceptance": delta("specdec:spec_decode_num_accepted_tokens_per_pos_total",
                                            '{position="0"}') / max(1.0, delta("specdec:spec_decode_num_drafts_total")),
            "acceptance_per_position": [round(x, 3) for x in per_pos],
            "tokens_per_forward": sum(o["usage"]["completion_tokens"] for o in out)
                                  / sum(s["target_forwards"] for s in spec),
            "seconds": round(seconds, 1)}


def wait_learnt(srv: Server, limit: float) -> tuple[float, float, float]:
    """Idle until the server's training budget is spent (or `limit` seconds) -> (seconds, updates, tokens)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        m = srv.metrics()
        if metric(m, "specdec:learn_pending_tokens") == 0:
            break
        time.sleep(2)
    m = srv.metrics()
    return time.perf_counter() - t0, metric(m, "specdec:learn_updates_total"), metric(m, "specdec:learn_tokens_total")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", choices=("eagle3", "hybrid"), default="eagle3", help="the requests' method")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed policy)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--idle-limit", type=float, default=600.0, help="longest wait for the learner between passes")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="after the passes, restart the server on its checkpoint and serve one more pass")
    p.add_argument("--json", type=Path, help="write the figures here too")
    a = p.parse_args()
    texts = [next(q for q in load_suite("mini", c)).turns[0] for c in CATEGORIES]
    with tempfile.TemporaryDirectory(prefix="learn-traffic-") as tmp:     # the learnt head goes with the run
        run_all(a, texts, Path(tmp) / "learnt.safetensors")


def run_all(a: argparse.Namespace, texts: list[str], checkpoint: Path) -> None:
    """The passes on one learning server, then (`--restart`) one more on a new server over its checkpoint."""
    srv = Server(a, checkpoint)
    rows, first = [], None
    try:
        for n in range(1, a.passes + 1):
            r = run_pass(srv, a, texts)
            first = first or r["texts"]
            waited, updates, tokens = wait_learnt(srv, a.idle_limit) if n < a.passes else (0.0, 0.0, 0.0)
            rows.append({"pass": n, **{k: v for k, v in r.items() if k != "texts"}, "identical": r["texts"] == first,
                         "idle_learning_seconds": round(waited, 1), "updates_after": updates, "tokens_after": tokens})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        srv.stop()
    if a.restart:
        srv = Server(a, checkpoint)
        try:
            r = run_pass(srv, a, texts)
            rows.append({"pass": "restart", **{k: v for k, v in r.items() if k != "texts"},
                         "identical": r["texts"] == first})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            srv.stop()
    print(f"command: specdec {srv.cmd}")
    if a.json:
        a.json.write_text(json.dumps({"command": srv.cmd, "passes": rows}, indent=2))


if __name__ == "__main__":
    main()
