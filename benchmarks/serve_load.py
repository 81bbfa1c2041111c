"""Load test of `specdec serve` over loopback (a benchmark, not CI).

Starts its own server subprocess on a free port, then:
1. burst: N streaming chat requests sent at once (default 200);
2. soak: a steady concurrency of 16 for --soak-seconds (default 600), sampling the
   server's resident memory (RSS) over time;
3. batching: the same requests at concurrency 8 against this server (batched) and
   against a second server started with --max-batch 1 (one at a time);
4. two-turn chats (MT-bench's 80 two-turn questions, the first --conversations): each
   conversation's second turn resends the first turn and its answer, against a server with
   the prefix cache (default) and one with --prefix-cache-mb 0;
5. a repeated task (an agent's or a pipeline's workload: the same instruction with different
   inputs, benchmarks/repeated_task.py), one request at a time, against one server per method of
   --repeated-methods (default none,ngram,suffix) running side by side, each request sent to every
   server in turn; the first --repeated-warmup requests are not timed (they fill suffix decoding's
   index of earlier outputs).
Reports requests/s, output tokens/s, p50/p99 time to first token and inter-token
latency (client side, per streamed chunk), errors, RSS samples and the batching speed-up.

    .venv/bin/python benchmarks/serve_load.py [--requests 200] [--soak-seconds 600] [--method ngram] [--json out.json]

The client is a minimal asyncio HTTP/1.0 client (SSE lines until the server closes
the connection) so that it takes as little as possible of the CPU the server needs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from repeated_task import prompts as repeated_prompts
from specdec.bench.suites import load_suite

HOST = "127.0.0.1"


# ---- the server under test ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`specdec serve` in a subprocess on a free loopback port."""

    def __init__(self, args: argparse.Namespace, max_batch: int, prefix_cache_mb: int = 512, method: str = "") -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--method", method or args.method,
               "--dtype", args.dtype, "--port", str(self.port), "--max-batch", str(max_batch),
               "--max-waiting", str(max(256, args.requests)), "--max-tokens", str(args.max_tokens),
               "--num-draft-tokens", str(args.num_draft_tokens), "--draft-policy", args.draft_policy,
               "--prefix-cache-mb", str(prefix_cache_mb)]
        if args.draft_model and not method:
            cmd += ["--draft-model", args.draft_model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.prefill_threads:
            cmd += ["--prefill-threads", str(args.prefill_threads)]
        self.cmd = cmd
        self.log = tempfile.TemporaryFile("w+")            # not a pipe: a chatty server must never block on it
        env = dict(os.environ)
        if args.omp_passive:
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # spinning OpenMP threads collapse on a shared machine
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env)
        self._wait_healthy(240)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"server exited with {self.proc.returncode}: {self.log.read()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit("server did not become healthy")

    def step_counters(self) -> dict[str, float]:
        """The server's engine-step counters from /metrics: {"<kind>_<steps|seconds|sequences>": value},
        plus "prefix_queries" and "prefix_hits" (prompt tokens)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            for what in ("queries", "hits"):
                if line.startswith(f"specdec:prefix_cache_{what}_total "):
                    out[f"prefix_{what}"] = float(line.split()[-1])
            for what in ("steps", "seconds", "sequences"):
                name = "specdec:engine_steps_total{" if what == "steps" else f"specdec:engine_step_{what}_total{{"
                if line.startswith(name):
                    kind = line.split('kind="')[1].split('"')[0]
                    out[f"{kind}_{what}"] = float(line.split()[-1])
        return out

    def rss_mb(self) -> float:
        try:
            import psutil
            return psutil.Process(self.proc.pid).memory_info().rss / 2 ** 20
        except ImportError:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RssSampler:
    """Samples the server's RSS every `every` seconds in a thread."""

    def __init__(self, server: ServerProcess, every: float) -> None:
        self.server, self.every = server, every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self.t0, self.server.rss_mb()))
            self._stop.wait(self.every)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self.thread.join()
        return self.samples


# ---- the client -------------------------------------------------------------------------------
@dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""


REQUEST_TIMEOUT = 600.0


async def stream_chat(port: int, prompt: str | list[dict], max_tokens: int) -> Outcome:
    """One streaming chat request: a user message or a whole conversation (an error after REQUEST_TIMEOUT seconds)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        return await asyncio.wait_for(_stream_chat(port, messages, max_tokens), REQUEST_TIMEOUT)
    except asyncio.TimeoutError:
        return Outcome(False, error=f"no complete answer within {REQUEST_TIMEOUT:g} s")


async def _stream_chat(port: int, messages: list[dict], max_tokens: int) -> Outcome:
    """One streaming chat request; TTFT and the gaps between content chunks, from the client's side."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.0\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as e:
        return Outcome(False, error=f"connect: {e}")
    out = Outcome(False)
    try:
        writer.write(head + body)
        await writer.drain()
        status = (await reader.readline()).decode().split()
        if len(status) < 2 or status[1] != "200":
            return Outcome(False, error=f"HTTP {' '.join(status[1:])}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        last = None
        async for raw in reader:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                out.ok = True
                break
            obj = json.loads(data)
            if "error" in obj:
                out.error = obj["error"]["message"]
                break
            if obj.get("usage"):
                out.tokens = obj["usage"]["completion_tokens"]
            if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                out.text += obj["choices"][0]["delta"]["content"]
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - t0
                else:
                    out.gaps.append(now - last)
                last = now
        if not out.ok and not out.error:
            out.error = "stream ended without [DONE]"
    except (OSError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def step_summary(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """Where the server's worker spent a phase: engine steps by kind, mean decode batch, busy share of the wall."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    busy = d.get("prefill_seconds", 0.0) + d.get("decode_seconds", 0.0)
    return {"prefill_steps": int(d.get("prefill_steps", 0)), "prefill_s": d.get("prefill_seconds", 0.0),
            "decode_steps": int(d.get("decode_steps", 0)), "decode_s": d.get("decode_seconds", 0.0),
            "prefix_queried_tokens": int(d.get("prefix_queries", 0)), "prefix_hit_tokens": int(d.get("prefix_hits", 0)),
            "mean_decode_batch": d.get("decode_sequences", 0.0) / max(1.0, d.get("decode_steps", 0.0)),
            "ms_per_decode_step": 1e3 * d.get("decode_seconds", 0.0) / max(1.0, d.get("decode_steps", 0.0)),
            "worker_busy_share": busy / wall}


def summarize(name: str, outcomes: list[Outcome], wall: float) -> dict:
    good = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in good)
    gaps = [g for o in good for g in o.gaps]
    errors = [o.error for o in outcomes if not o.ok]
    return {"phase": name, "requests": len(outcomes), "errors": len(errors), "first_errors": errors[:3],
            "wall_s": wall, "requests_per_s": len(good) / wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile([o.ttft for o in good], 0.5), "ttft_p99_s": percentile([o.ttft for o in good], 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99)}


async def burst(port: int, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[Outcome], float]:
    """All prompts, at most `concurrency` in flight at once."""
    gate = asyncio.Semaphore(concurrency)

    async def one(p: str) -> Outcome:
        async with gate:
            return await stream_chat(port, p, max_tokens)

    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(one(p) for p in prompts))
    return list(outcomes), time.perf_counter() - t0


async def soak(port: int, prompts: list[str], max_tokens: int, concurrency: int, seconds: float) -> tuple[list[Outcome], float]:
    """`concurrency` clients, each sending requests back to back until the time is up."""
    deadline = time.perf_counter() + seconds
    outcomes: list[Outcome] = []

    async def client(i: int) -> None:
        n = i
        while time.perf_counter() < deadline:
            outcomes.append(await stream_chat(port, prompts[n % len(prompts)], max_tokens))
            n += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return outcomes, time.perf_counter() - t0


async def conversations(port: int, pairs: list[tuple[str, str]], max_tokens: int, concurrency: int
                        ) -> tuple[list[Outcome], list[Outcome], float]:
    """Two-turn chats, at most `concurrency` at once: the second turn carries the first and its answer."""
    gate = asyncio.Semaphore(concurrency)

    async def one(q1: str, q2: str) -> tuple[Outcome, Outcome]:
        async with gate:
            first = await stream_chat(port, q1, max_tokens)
            if not first.ok:
                return first, Outcome(False, error="first turn failed")
            turn2 = [{"role": "user", "content": q1}, {"role": "assistant", "content": first.text},
                     {"role": "user", "content": q2}]
            return first, await stream_chat(port, turn2, max_tokens)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(a, b) for a, b in pairs))
    return [a for a, _ in done], [b for _, b in done], time.perf_counter() - t0


# ---- report -----------------------------------------------------------------------------------
def show(row: dict) -> str:
    line = (f"{row['phase']:<22} {row['requests']:>5} req  {row['errors']:>3} err  {row['wall_s']:7.1f} s  "
            f"{row['requests_per_s']:6.2f} req/s  {row['output_tokens_per_s']:7.1f} tok/s  "
            f"TTFT p50 {row['ttft_p50_s'] * 1e3:7.0f} ms p99 {row['ttft_p99_s'] * 1e3:7.0f} ms  "
            f"ITL p50 {row['itl_p50_s'] * 1e3:5.0f} ms p99 {row['itl_p99_s'] * 1e3:5.0f} ms")
    s = row.get("steps")
    if s:
        line += (f"\n{'':<22} worker: {s['prefill_steps']} prefill steps {s['prefill_s']:.1f} s, "
                 f"{s['decode_steps']} decode steps {s['decode_s']:.1f} s ({s['ms_per_decode_step']:.0f} ms each, "
                 f"mean batch {s['mean_decode_batch']:.2f}), busy {100 * s['worker_busy_share']:.0f}% of the wall; "
                 f"prefix cache: {s['prefix_hit_tokens']} of {s['prefix_queried_tokens']} prompt tokens")
    return line


def measured(server: ServerProcess, name: str, run) -> dict:
    """Run one phase (`run()` -> (outcomes, wall)) and summarize it with the server's step counters."""
    before = server.step_counters()
    outs, wall = run()
    row = summarize(name, outs, wall)
    row["steps"] = step_summary(before, server.step_counters(), wall)
    print(show(row), flush=True)
    return row


def rss_summary(samples: list[tuple[float, float]]) -> dict:
    mb = [m for _, m in samples]
    k = max(1, len(mb) // 5)
    return {"samples": len(mb), "first_mb": mb[0], "min_mb": min(mb), "max_mb": max(mb), "last_mb": mb[-1],
            "mean_first_fifth_mb": statistics.mean(mb[:k]), "mean_last_fifth_mb": statistics.mean(mb[-k:]),
            "series": [(round(t, 1), round(m, 1)) for t, m in samples]}


def repeated_task(args: argparse.Namespace) -> dict:
    """Phase 5: the repeated task, one request at a time, every request to each method's server in turn."""
    methods = args.repeated_methods.split(",")
    prompts = repeated_prompts(args.repeated_requests)
    servers = {m: ServerProcess(args, 1, args.prefix_cache_mb, method=m) for m in methods}
    runs: dict[str, list[Outcome]] = {m: [] for m in methods}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for srv in servers.values():
            asyncio.run(burst(srv.port, ["Say hello."], 8, 1))                  # warm-up (not the task)
        for p in prompts:
            for m, srv in servers.items():
                t0 = time.perf_counter()
                runs[m].append(asyncio.run(stream_chat(srv.port, p, args.max_tokens)))
                walls[m].append(time.perf_counter() - t0)
    finally:
        for srv in servers.values():
            srv.stop()
    base, w = methods[0], args.repeated_warmup
    out: dict = {"requests": len(prompts), "warmup": w, "methods": {}}
    for m in methods:
        timed = list(zip(runs[m][w:], walls[m][w:], walls[base][w:], runs[base][w:]))
        tokens = sum(o.tokens for o, *_ in timed)
        row = {"errors": sum(not o.ok for o in runs[m]),
               "output_tokens_per_s": tokens / max(1e-9, sum(s for _, s, _, _ in timed)),
               "median_speedup": statistics.median(b / s * o.tokens / max(1, ob.tokens) for o, s, b, ob in timed),
               "texts_equal_to_baseline": sum(o.text == ob.text for o, ob in zip(runs[m], runs[base]))}
        out["methods"][m] = row
        print(f"repeated task {m:<10} {row['output_tokens_per_s']:7.1f} tok/s  {row['median_speedup']:.2f}x vs {base} "
              f"(median per request)  {row['texts_equal_to_baseline']}/{len(prompts)} texts = {base}  "
              f"{row['errors']} err", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-policy", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="server torch threads (0 = default)")
    ap.add_argument("--prefill-threads", type=int, default=0, help="server torch threads while prefilling (0 = default)")
    ap.add_argument("--omp-passive", action=argparse.BooleanOptionalAction, default=False,
                    help="run the server with OMP_WAIT_POLICY=PASSIVE (unless already set)")
    ap.add_argument("--max-batch", type=int, default=16, help="server batch slots for the burst and the soak")
    ap.add_argument("--requests", type=int, default=200, help="requests in the burst (all sent at once)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--soak-seconds", type=float, default=600.0)
    ap.add_argument("--soak-concurrency", type=int, default=16)
    ap.add_argument("--compare-requests", type=int, default=32, help="requests in the batched vs one-at-a-time run (0 = skip)")
    ap.add_argument("--compare-concurrency", type=int, default=8)
    ap.add_argument("--prefix-cache-mb", type=int, default=512,
                    help="the servers' prefix cache for the burst, soak and batching phases (0 = off; the burst and "
                         "soak cycle through 21 prompts, so repeated long prompts hit it)")
    ap.add_argument("--conversations", type=int, default=16,
                    help="two-turn MT-bench chats, with and without the prefix cache (0 = skip)")
    ap.add_argument("--conversation-concurrency", type=int, default=8)
    ap.add_argument("--repeated-requests", type=int, default=24, help="requests of the repeated task (0 = skip)")
    ap.add_argument("--repeated-warmup", type=int, default=4, help="first repeated-task requests not timed")
    ap.add_argument("--repeated-methods", default="none,ngram,suffix", help="one server each; the first is the baseline")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    suite = [p.turns[0] for p in load_suite("mini")]
    prompts = [suite[i % len(suite)] for i in range(args.requests)]
    compare = [suite[i % len(suite)] for i in range(args.compare_requests)]
    result: dict = {"args": vars(args), "cpus": os.cpu_count()}

    server = ServerProcess(args, args.max_batch, args.prefix_cache_mb)
    result["server_cmd"] = " ".join(server.cmd[1:])
    sampler = RssSampler(server, args.rss_every)
    try:
        asyncio.run(burst(server.port, suite[:2], 8, 2))                       # warm-up (not measured)
        rows = []
        if args.requests > 0:
            rows.append(measured(server, f"burst x{args.requests}", lambda: asyncio.run(
                burst(server.port, prompts, args.max_tokens, args.requests))))
        if args.soak_seconds > 0:
            rows.append(measured(server, f"soak c={args.soak_concurrency}", lambda: asyncio.run(
                soak(server.port, suite, args.max_tokens, args.soak_concurrency, args.soak_seconds))))
        if compare:
            rows.append(measured(server, f"batched c={args.compare_concurrency}", lambda: asyncio.run(
                burst(server.port, compare, args.max_tokens, args.compare_concurrency))))
    finally:
        result["rss"] = rss_summary(sampler.stop())
        server.stop()

    if compare:
        one = ServerProcess(args, 1, args.prefix_cache_mb)
        try:
            asyncio.run(burst(one.port, suite[:1], 8, 1))
            rows.append(measured(one, f"one-at-a-time c={args.compare_concurrency}", lambda: asyncio.run(
                burst(one.port, compare, args.max_tokens, args.compare_concurrency))))
        finally:
            one.stop()
        result["batching_speedup"] = rows[-2]["output_tokens_per_s"] / rows[-1]["output_tokens_per_s"]
    if args.conversations > 0:
        two = [(p.turns[0], p.turns[1]) for p in load_suite("full", ["mt_bench"]) if len(p.turns) == 2]
        pairs = two[:args.conversations]
        ttft2 = {}
        for mb in (512, 0):
            srv = ServerProcess(args, args.conversation_concurrency, mb)
            try:
                asyncio.run(burst(srv.port, suite[:2], 8, 2))
                before = srv.step_counters()
                first, second, wall = asyncio.run(conversations(srv.port, pairs, args.max_tokens,
                                                                args.conversation_concurrency))
                label = f"prefix cache {mb} MB" if mb else "no prefix cache"
                r1 = summarize(f"chat turn 1, {label}", first, wall)
                r2 = summarize(f"chat turn 2, {label}", second, wall)
                r2["steps"] = step_summary(before, srv.step_counters(), wall)
                for r in (r1, r2):
                    print(show(r), flush=True)
                rows += [r1, r2]
                ttft2[mb] = r2["ttft_p50_s"]
            finally:
                srv.stop()
        result["turn2_ttft_p50_without_over_with_prefix_cache"] = ttft2[0] / ttft2[512]
        print(f"second-turn TTFT p50: {ttft2[512] * 1e3:.0f} ms with the prefix cache, {ttft2[0] * 1e3:.0f} ms without")
    if args.repeated_requests > 0:
        result["repeated_task"] = repeated_task(args)
    result["phases"] = rows
    rss = result["rss"]
    if compare:
        print(f"batching speed-up at concurrency {args.compare_concurrency}: {result['batching_speedup']:.2f}x "
              f"(output tokens/s, batched vs --max-batch 1)")
    print(f"server RSS: first {rss['first_mb']:.0f} MB, min {rss['min_mb']:.0f}, max {rss['max_mb']:.0f}, "
          f"last {rss['last_mb']:.0f}; mean of first fifth {rss['mean_first_fifth_mb']:.0f} MB, "
          f"last fifth {rss['mean_last_fifth_mb']:.0f} MB ({rss['samples']} samples every {args.rss_every:g} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    errors = any(r["errors"] for r in rows) or any(r["errors"] for r in result.get("repeated_task", {}).get("methods", {}).values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
