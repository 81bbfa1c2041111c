"""The resident memory of `specdec serve` as requests name other speculative methods (a benchmark, not CI).

Starts `specdec serve` (default flags plus whatever follows `--`) on a free loopback port, samples its
RSS (/proc/PID/status VmRSS) once it answers, then after one short greedy completion naming each of
--methods in turn (each builds an engine of its own: caches and the method's draft weights), and prints
one JSON line per sample: {"after": ..., "status": HTTP status, "rss_mb": ...}.

    .venv/bin/python benchmarks/serve_memory.py [--methods eagle3,suffix,eagle] [-- --max-engines 2]
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        print(f"  {e.code}: {json.loads(e.read())['error']['message']}", file=sys.stderr)
        return e.code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="eagle3,suffix,eagle")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds to wait before each sample (idle trim)")
    ap.add_argument("serve_args", nargs="*", help="more `specdec serve` flags (after --)")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), *a.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.2)
        model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        time.sleep(a.settle)
        print(json.dumps({"after": "start", "status": 200, "rss_mb": round(rss_mb(proc.pid))}), flush=True)
        for method in a.methods.split(","):
            status = post(url + "/v1/completions", {"model": model, "prompt": "The three primary colors are",
                                                    "max_tokens": 16, "temperature": 0,
                                                    "speculative": {"method": method}})
            time.sleep(a.settle)
            print(json.dumps({"after": method, "status": status, "rss_mb": round(rss_mb(proc.pid))}), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
