"""Serving under load: continuous batching against one request at a time, in one run.

    python benchmarks/serve_load.py [--rates 0.5,2,8] [--requests 24] [--max-batch 8]
        [--method sjd] [--window auto] [--model builtin] [--time-limit 300]
        [--ray 1,2 --cores 2] [--skip-single]

For each server setting (`--max-batch N`: continuous batching; `--max-batch 1`: one request at
a time, the same engine held to one row) a `speculaas serve` process on loopback, then for each
arrival rate an open-loop client: requests at Poisson arrival times (exponential gaps, seeded),
each on its own thread, bounded by --requests and --time-limit. Per (setting, rate): completed
and failed requests, throughput (images per second over the span from the first arrival to the
last answer), p50 / p95 / p99 latency (arrival to answer), mean batch the images were decoded
in, and the windows chosen. Also the latency of requests sent one at a time, back to back, to
the continuous-batching server, against a solo generate() call per prompt in this process
(--ray N,M: also `speculaas serve --ray` with N, M replicas sharing --cores CPUs; a local Ray
cluster each, its replicas warmed before the load)
(the reference latency of an idle server). Warm-up requests of n = 8, 4, 2, 1 images first
measure the lane's cost curve at every batch size (cached on disk afterwards). Last line: JSON
of every row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx

import speculaas as sp
from speculaas.bench.prompts import load_prompts


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, max_batch: int, replicas: int = 0,
           cores: int = 2) -> tuple[subprocess.Popen, str]:
    """A server on loopback: one process (replicas 0), or Ray Serve with that many replicas
    sharing `cores` CPUs (each replica's PyTorch gets its share of threads)."""
    port = _free_port()
    ray = ([] if not replicas else
           ["--ray", "--replicas", str(replicas), "--replica-cpus", str(cores / replicas)])
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stall the server
    proc = subprocess.Popen([sys.executable, "-m", "speculaas.cli", "serve", "--model", model,
                             "--port", str(port), "--max-batch", str(max_batch),
                             "--queue", "1000", *ray], stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # the warm-up times the lane (120 s each at most)
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"the server did not start: {log.read()}")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_load(url: str, prompts: list, rate: float, n: int, body: dict, limit: float,
             seed: int = 0) -> dict:
    """Open loop: n requests at Poisson times of `rate` per second, each on its own thread."""
    rng = random.Random(seed)
    results: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int, at: float) -> None:
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        start = time.perf_counter()
        try:
            r = httpx.post(f"{url}/v1/images/generations", timeout=limit,
                           json={**body, "prompt": str(prompts[i % len(prompts)]), "seed": i})
            ok = r.status_code == 200
            stats = r.json()["speculaas"][0] if ok else None
        except httpx.HTTPError:
            ok, stats = False, None
        with lock:
            results.append({"ok": ok, "arrival": start - t0, "latency": time.perf_counter() - start,
                            "stats": stats})

    at, threads = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        if at > limit:
            break
        th = threading.Thread(target=one, args=(i, at), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(limit + 60)
    done = [r for r in results if r["ok"]]
    span = (max(r["arrival"] + r["latency"] for r in done) - min(r["arrival"] for r in done)
            if done else float("nan"))
    lat = [r["latency"] for r in done]
    windows = Counter()
    for r in done:
        windows.update({int(w): k for w, k in r["stats"]["windows"].items()})
    return {"rate": rate, "sent": len(results), "done": len(done),
            "failed": len(results) - len(done),
            "throughput": len(done) / span if done else 0.0,
            "p50": _pct(lat, 0.5), "p95": _pct(lat, 0.95), "p99": _pct(lat, 0.99),
            "mean_batch": statistics.mean(r["stats"]["mean_batch"] for r in done) if done
            else float("nan"),
            "windows": dict(sorted(windows.items()))}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--rates", default="0.5,2,8", help="arrivals per second")
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--method", default="sjd")
    p.add_argument("--window", default="auto")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per rate")
    p.add_argument("--ray", default="", metavar="N,M",
                   help="also Ray Serve (speculaas serve --ray) with N, M, ... replicas of "
                        "max batch --max-batch, sharing --cores CPUs")
    p.add_argument("--cores", type=int, default=2, help="CPUs the Ray replicas share")
    p.add_argument("--skip-single", action="store_true",
                   help="leave out the one-request-at-a-time server")
    args = p.parse_args(argv)
    window = args.window if args.window == "auto" else int(args.window)
    body = {"method": args.method, "window": window, "response_format": "b64_json"}
    prompts = (load_prompts("builtin-set", 16, "builtin") if args.model == "builtin"
               else list(range(10)))
    rows, idle_p50 = [], float("nan")
    servers = [("process", args.max_batch, 0)]
    servers += [] if args.skip_single else [("process", 1, 0)]
    servers += [(f"ray x{n}", args.max_batch, int(n)) for n in args.ray.split(",") if n]
    for kind, max_batch, replicas in servers:
        proc, url = _start(args.model, max_batch, replicas, args.cores)
        try:  # warm-up: caches, and the lane's cost curve at every batch size it will see
            for n in sorted({min(max_batch, k) for k in (8, 4, 2, 1)}, reverse=True):
                httpx.post(f"{url}/v1/images/generations", timeout=args.time_limit,
                           json={**body, "prompt": str(prompts[0]), "n": n})
            for _ in range(2 * replicas):  # every replica warmed (routing spreads them)
                httpx.post(f"{url}/v1/images/generations", timeout=args.time_limit,
                           json={**body, "prompt": str(prompts[0]), "n": max_batch})
            if kind == "process" and max_batch == args.max_batch:  # one at a time, back to back
                idle = []
                for i, prompt in enumerate(prompts[:8]):
                    t0 = time.perf_counter()
                    httpx.post(f"{url}/v1/images/generations", timeout=args.time_limit,
                               json={**body, "prompt": str(prompt), "seed": i})
                    idle.append(time.perf_counter() - t0)
                idle_p50 = statistics.median(idle)
                print(f"one request at a time (back to back): median latency {idle_p50:.2f} s",
                      flush=True)
            for rate in (float(r) for r in args.rates.split(",")):
                row = {"server": kind, "max_batch": max_batch,
                       **run_load(url, prompts, rate, args.requests, body, args.time_limit)}
                rows.append(row)
                print(f"{kind:8s} max_batch {max_batch:2d}  rate {rate:5.2f}/s  done "
                      f"{row['done']:3d} "
                      f"failed {row['failed']}  {row['throughput']:.2f} img/s  p50 "
                      f"{row['p50']:.2f} s  p95 {row['p95']:.2f} s  p99 {row['p99']:.2f} s  "
                      f"batch {row['mean_batch']:.2f}  windows {row['windows']}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    model = sp.load_model(args.model)
    solo = []
    for i, prompt in enumerate(prompts[:8]):
        out = sp.generate(model, [prompt], method=args.method, seed=i, window=window)
        solo.append(out.latency_s)
    reference = {"solo_generate_p50": statistics.median(solo), "server_idle_p50": idle_p50}
    print(f"solo generate(): median latency {reference['solo_generate_p50']:.2f} s per image; "
          f"the server with one request at a time: {idle_p50:.2f} s "
          f"({idle_p50 / reference['solo_generate_p50']:.2f}x)")
    print("| server | max batch | rate (/s) | done | failed | img/s | p50 (s) | p95 (s) | "
          "p99 (s) | mean batch | windows |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['max_batch']} | {r['rate']} | {r['done']} | {r['failed']} | "
              f"{r['throughput']:.2f} | {r['p50']:.2f} | {r['p95']:.2f} | {r['p99']:.2f} | "
              f"{r['mean_batch']:.2f} | {r['windows']} |")
    print(json.dumps({"rows": rows, **reference}))
    return rows


if __name__ == "__main__":
    main()
