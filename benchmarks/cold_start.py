"""Time to first token and total time of the README's first command from a cold cost-curve
cache, on a machine kept busy by `--busy` busy-loop processes that this script starts and stops.

    python benchmarks/cold_start.py --busy 2                       # this checkout
    python benchmarks/cold_start.py --busy 2 --src /tmp/old/src    # another checkout's package

Each run gets an empty SPECULAAS_CACHE_DIR; the first token is the first time the progress bar
on stderr shows a committed token. Prints one line per run and, last, a JSON of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

COMMAND = ["generate", "--prompt", "a big red circle on the left over grass", "--method", "csd",
           "--cfg-scale", "2"]
BAR = re.compile(r"(\d+)/(\d+) \[")


def run_once(src: str | None, out_dir: str, limit_s: float) -> dict:
    env = dict(os.environ, SPECULAAS_CACHE_DIR=tempfile.mkdtemp(prefix="cold-"))
    if src:
        env["PYTHONPATH"] = src
    code = "import sys; from speculaas.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *COMMAND, "--out", os.path.join(out_dir, "out.png")]
    first: list[float] = []
    said: list[str] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE)

    def read() -> None:
        buf = ""
        while chunk := proc.stderr.read1(256).decode(errors="replace"):
            buf += chunk
            if not first and any(int(m.group(1)) > 0 for m in BAR.finditer(buf)):
                first.append(time.perf_counter() - t0)
            if "timing" in chunk:
                said.append(chunk.strip()[:120])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    total = time.perf_counter() - t0
    reader.join(timeout=5)
    return {"first_token_s": round(first[0], 2) if first else None, "total_s": round(total, 2),
            "rc": proc.returncode, "timed_up_front": bool(said)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the run")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--src", default=None, help="PYTHONPATH of the package to time")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds before a run is killed")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            runs = [run_once(args.src, out_dir, args.limit) for _ in range(args.runs)]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    for r in runs:
        print(r, flush=True)
    firsts = [r["first_token_s"] for r in runs if r["first_token_s"] is not None]
    print(json.dumps({"busy": args.busy, "src": args.src or "this checkout",
                      "first_token_s": statistics.median(firsts) if firsts else None,
                      "total_s": statistics.median(r["total_s"] for r in runs)}))


if __name__ == "__main__":
    main()
