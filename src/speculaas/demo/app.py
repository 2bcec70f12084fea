"""`speculaas demo`: a local page that draws a caption with a method (and with AR on the same
seed) and shows where decoding sped up.

A FastAPI app: GET / serves the page, GET /api/config the model's defaults and limits,
POST /api/generate runs one request. Requests are validated before they queue (a bad one is
answered 400 at once), generations of all users go to one continuous-batching engine
(serve/engine.py: they decode together, each with its own seed) from worker threads so the
server keeps answering (the two-dimensional window, which the engine does not run, one at a
time beside it), at most `QUEUE_LIMIT` requests are in flight (the next gets 503 with
Retry-After at once), work whose client has gone is cancelled, and every request has a time
limit.
"""


import asyncio
import base64
import io
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..api import METHODS, generate
from ..bench.maps import raster_order, run_lengths
from ..checks import is_integer, is_number
from ..config import COUPLINGS, DEFAULT_COUPLING, DEFAULT_DRAFT_INIT, DRAFT_INITS, JacobiConfig
from ..decoding.frontier_rows import check_row_context

LIMITS = {"caption_chars": 300, "window": (1, 64), "row_context": (1, 64), "lam": (0.0, 10.0),
          "delta": (0.0, 1.0),
          "temperature": (0.05, 5.0), "cfg_scale": (0.0, 20.0), "seed": (0, 2**31 - 1)}
PREVIEWS = 3  # pictures of a decode in progress sent to a streamed request
QUEUE_LIMIT = 4  # requests in flight (decoding together or waiting); more get 503 at once
TIME_LIMIT_S = 60.0  # per request, queueing excluded


class Cancelled(Exception):
    """The client left, or the request ran out of time."""


class _Watch:
    """Stands in for the progress bar of generate(): every loop iteration it checks whether
    the request should stop, so cancelling costs at most one iteration. preview: where the
    pictures of a decode in progress go (method, PIL image), for a streamed request."""

    def __init__(self, stop: threading.Event, deadline: float, preview=None) -> None:  # noqa: ANN001
        self.stop, self.deadline, self.preview = stop, deadline, preview

    def update(self, n: int = 1) -> None:
        if self.stop.is_set():
            raise Cancelled("the client left")
        if time.monotonic() > self.deadline:
            raise Cancelled(f"the request took longer than {TIME_LIMIT_S:.0f} s")

    def close(self) -> None:
        pass
EXAMPLES = [
    "a big red circle on the left over grass",
    "a small blue square on the right at sunset",
    "a big yellow triangle on the center under a blue sky",
    "a big white diamond on the left in front of a brick wall",
    "a small green circle on the right over gravel",
]
PAGE = Path(__file__).with_name("page.html")


def _png(img: Image.Image, size: int = 256) -> str:
    buf = io.BytesIO()
    img.resize((size, size), Image.NEAREST).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _heat(values: np.ndarray, vmin: float, vmax: float, cmap: str) -> Image.Image:
    import matplotlib

    norm = (values - vmin) / max(vmax - vmin, 1e-9)
    rgba = matplotlib.colormaps[cmap](np.clip(norm, 0, 1))
    return Image.fromarray((rgba[..., :3] * 255).astype(np.uint8))


def _number(form: dict, key: str, default, cast=float):  # noqa: ANN001, ANN202
    """A JSON number (null or absent: the default); strings and bools are refused."""
    raw = form.get(key, None)
    if raw is None:
        return default
    if cast is int and not is_integer(raw):
        raise ValueError(f"{key} must be a whole number, got {raw!r}")
    if not is_number(raw) or not math.isfinite(raw):
        raise ValueError(f"{key} must be a finite number, got {raw!r}")
    value = cast(raw)
    lo, hi = LIMITS[key]
    if not lo <= value <= hi:
        raise ValueError(f"{key} must be between {lo} and {hi}, got {value}")
    return value


def parse_request(form: dict, model) -> dict:  # noqa: ANN001
    """Validate a form into generate() arguments; raises ValueError with a readable message."""
    caption = form.get("caption", "")
    if not isinstance(caption, str):
        raise ValueError(f"caption must be text, got {caption!r}")
    caption = caption.strip()
    if not caption:
        raise ValueError("please enter a caption")
    if len(caption) > LIMITS["caption_chars"]:
        raise ValueError(f"the caption has {len(caption)} characters; the limit is "
                         f"{LIMITS['caption_chars']}")
    method = form.get("method", "csd")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    compare = form.get("compare", False)
    if not isinstance(compare, bool):
        raise ValueError(f"compare must be true or false, got {compare!r}")
    for key, valid in (("coupling", COUPLINGS), ("draft_init", DRAFT_INITS)):
        if form.get(key) is not None and form[key] not in valid:
            raise ValueError(f"unknown {key} {form[key]!r}; choose one of {', '.join(valid)}")
    d = model.defaults
    window = form.get("window")
    args = {
        "method": method,
        "window": "auto" if window == "auto" else _number(form, "window", None, int),
        "coupling": form.get("coupling") or DEFAULT_COUPLING,
        "draft_init": form.get("draft_init") or DEFAULT_DRAFT_INIT,
        "temperature": _number(form, "temperature", d.temperature),
        "cfg_scale": _number(form, "cfg_scale", d.cfg_scale or 1.0),
        "seed": _number(form, "seed", 0, int),
    }
    row_context = _number(form, "row_context", None, int)
    if row_context is not None:
        jacobi = JacobiConfig(window=args["window"], row_context=row_context)
        check_row_context(model, jacobi, speculative=method != "ar")
        args["row_context"] = row_context
    if method == "csd":
        args["lam"] = _number(form, "lam", 0.5)
        args["delta"] = _number(form, "delta", 0.65)
    model.check_prompts([caption])  # the model's own grammar check
    return {"caption": caption, "compare": compare, **args}


def _scale(cmap: str, vmin: float, vmax: float, stops: int = 6) -> dict:
    """A colour scale the page draws beside a map: CSS colours from low to high, and the ends."""
    import matplotlib

    colours = matplotlib.colormaps[cmap](np.linspace(0, 1, stops))
    css = ["#" + "".join(f"{int(round(c * 255)):02x}" for c in rgba[:3]) for rgba in colours]
    return {"colours": css, "min": vmin, "max": vmax}


def _run(model, caption, r: dict, watch: _Watch | None, engine=None) -> dict:  # noqa: ANN001
    """One decode: through the shared engine (batched with other users' requests) where it can
    take it, else a generate() call of its own (the two-dimensional window)."""
    if engine is None or "row_context" in r:
        out = generate(model, [caption], progress=watch or False, **r)
        return {"image": out.images[0], "steps": out.commit_step[0], "entropy": out.entropy[0],
                "forward_passes": int(out.forward_passes[0]), "tokens": out.tokens.shape[1],
                "latency_s": out.latency_s, "mean_window": float(out.mean_window[0]),
                "mean_batch": 1.0}
    from ..serve.engine import Cancelled as EngineCancelled
    from ..serve.engine import Request as EngineRequest

    options = {k: r[k] for k in ("lam", "delta") if k in r}
    req = EngineRequest(prompt=caption, seed=r["seed"], method=r["method"],
                        window=r.get("window") or "auto", temperature=r["temperature"],
                        cfg_scale=r["cfg_scale"], options=options,
                        coupling=r.get("coupling", DEFAULT_COUPLING),
                        draft_init=r.get("draft_init", DEFAULT_DRAFT_INIT),
                        deadline=None if watch is None else watch.deadline)
    if watch is not None and watch.preview is not None:
        req.partial_images = PREVIEWS
        req.on_partial = lambda _req, _k, image: watch.preview(r["method"], image)
    future = engine.submit(req)
    while True:
        try:
            done = future.result(timeout=0.25)
            break
        except TimeoutError:
            if watch is not None and watch.stop.is_set():
                req.cancel()
        except EngineCancelled as e:
            raise Cancelled(str(e)) from None
    used = sum(done.windows.values())
    return {"image": done.image, "steps": done.commit_step, "entropy": done.entropy,
            "forward_passes": done.forward_passes, "tokens": len(done.tokens),
            "latency_s": done.decode_s,
            "mean_window": sum(w * n for w, n in done.windows.items()) / max(used, 1),
            "mean_batch": done.mean_batch}


def run_request(model, req: dict, watch: _Watch | None = None, engine=None) -> dict:  # noqa: ANN001
    caption, compare = req["caption"], req["compare"]
    args = {k: v for k, v in req.items() if k not in ("caption", "compare")}
    ar = {"method": "ar", "seed": args["seed"], "temperature": args["temperature"],
          "cfg_scale": args["cfg_scale"]}
    runs = [args] + ([ar] if compare and args["method"] != "ar" else [])
    results = []
    for r in runs:
        out = _run(model, caption, r, watch, engine)
        steps = out["steps"]
        runs_map = run_lengths(steps[None])[0].numpy()
        ent = out["entropy"].numpy()
        run_max, ent_max = max(int(runs_map.max()), 2), max(float(ent.max()), 1e-3)
        raster = raster_order(steps[None])  # the order map then says nothing
        results.append({
            "method": r["method"],
            "image": _png(out["image"]),
            "acceptance_map": _png(_heat(runs_map, 1, run_max, "viridis")),
            "acceptance_scale": _scale("viridis", 1, run_max),
            "entropy_map": _png(_heat(ent, 0, ent_max, "magma")),
            "entropy_scale": _scale("magma", 0, round(ent_max, 2)),
            "order_map": None if raster else _png(
                _heat(steps.numpy(), 0, max(int(steps.max()), 1), "cividis")),
            "order_scale": None if raster else _scale("cividis", 0, max(int(steps.max()), 1)),
            "forward_passes": out["forward_passes"],
            "tokens": out["tokens"],
            "step_compression": round(out["tokens"] / out["forward_passes"], 2),
            "latency_s": round(out["latency_s"], 3),
            "mean_window": round(out["mean_window"], 1),
            "mean_batch": round(out["mean_batch"], 2),  # images decoded beside it, on average
            "max_run": int(runs_map.max()),
        })
    return {"runs": results}


def create_app(model, engine=None, hosts: set[str] | None = None):  # noqa: ANN001, ANN201
    """The demo's app; `engine`: the serving engine its users share (None: one of its own on a
    background thread; `serve` runs it on the main thread instead); hosts: the Host headers it
    answers (serve.app.allowed_hosts; None: any). Generation takes JSON only as
    application/json and within the API server's body limit, so no other page can make it
    work."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

    from ..serve.app import Refused, check_caller, read_json
    from ..serve.engine import Engine

    app = FastAPI(title="speculaas demo")
    # Users' decodes share one continuous-batching engine (they batch together); the
    # two-dimensional window runs outside it, one at a time.
    if engine is None:
        engine = Engine(model, max_batch=QUEUE_LIMIT, queue_size=2 * QUEUE_LIMIT).start()
    app.state.engine = engine
    worker = ThreadPoolExecutor(max_workers=QUEUE_LIMIT, thread_name_prefix="speculaas-demo")
    alone = threading.Lock()
    waiting = {"n": 0}  # requests queued or running; touched only on the event loop

    def work(req: dict, stop: threading.Event, preview=None) -> dict:  # noqa: ANN001
        if stop.is_set():  # the client left while the request waited
            raise Cancelled("the client left")
        watch = _Watch(stop, time.monotonic() + TIME_LIMIT_S, preview)
        with torch.inference_mode():
            if "row_context" in req:
                with alone:
                    return run_request(model, req, watch)
            return run_request(model, req, watch, engine)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    @app.get("/api/config")
    def config() -> dict:
        d = model.defaults
        return {"methods": list(METHODS), "examples": EXAMPLES, "limits": LIMITS,
                "couplings": list(COUPLINGS), "draft_inits": list(DRAFT_INITS),
                "defaults": {"window": None, "temperature": d.temperature,
                             "cfg_scale": d.cfg_scale or 1.0, "lam": 0.5, "delta": 0.65,
                             "seed": 0, "coupling": DEFAULT_COUPLING,
                             "draft_init": DEFAULT_DRAFT_INIT},
                "model": model.name}

    @app.post("/api/generate")
    async def gen(request: Request):  # noqa: ANN202
        try:
            check_caller(request.headers, hosts, None)
            try:
                form = await read_json(request)
            except ValueError:
                raise ValueError("could not read the request: the body is not valid JSON") \
                    from None
            if not isinstance(form, dict):
                raise ValueError("the request must be a JSON object")
            stream = form.pop("stream", False)
            if not isinstance(stream, bool):
                raise ValueError(f"stream must be true or false, got {stream!r}")
            req = parse_request(form, model)
        except Refused as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except Exception:  # noqa: BLE001 - malformed JSON and the like
            return JSONResponse({"error": "could not read the request"}, status_code=400)
        if waiting["n"] >= QUEUE_LIMIT:
            return JSONResponse({"error": "the server is busy; try again in a few seconds"},
                                status_code=503, headers={"Retry-After": "5"})
        waiting["n"] += 1
        stop = threading.Event()
        if stream:
            loop, events = asyncio.get_running_loop(), asyncio.Queue()

            def preview(method: str, image: Image.Image) -> None:  # engine thread
                line = {"preview": _png(image), "method": method}
                loop.call_soon_threadsafe(events.put_nowait, line)

            job = loop.run_in_executor(worker, work, req, stop, preview)
            job.add_done_callback(lambda _: waiting.update(n=waiting["n"] - 1))
            return StreamingResponse(_stream(job, events, stop),
                                     media_type="application/x-ndjson")
        job = asyncio.get_running_loop().run_in_executor(worker, work, req, stop)
        try:
            while not job.done():  # the event loop stays free; a client that leaves cancels
                done, _ = await asyncio.wait({job}, timeout=0.25)
                if not done and await request.is_disconnected():
                    stop.set()
            return job.result()
        except Cancelled as e:
            return JSONResponse({"error": f"stopped: {e}"}, status_code=503,
                                headers={"Retry-After": "5"})
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        finally:
            waiting["n"] -= 1

    async def _stream(job: asyncio.Future, events: asyncio.Queue, stop: threading.Event):  # noqa: ANN202
        """A streamed generation, one JSON object per line: {"preview": PNG, "method"} as the
        engine commits rows, then {"result": what the plain call returns}, or {"error",
        "status"}. A client that leaves stops the work, as for the plain call."""
        try:
            while not (job.done() and events.empty()):
                try:
                    yield json.dumps(await asyncio.wait_for(events.get(), 0.25)) + "\n"
                except TimeoutError:
                    continue
            try:
                line = {"result": job.result()}
            except Cancelled as e:
                line = {"error": f"stopped: {e}", "status": 503}
            except ValueError as e:
                line = {"error": str(e), "status": 400}
            yield json.dumps(line) + "\n"
        finally:
            if not job.done():  # the client left mid-stream
                stop.set()

    return app


def serve(model_name: str = "builtin", host: str = "127.0.0.1", port: int = 7860,
          weights: str | None = None, drafter: str | None = None) -> None:
    """Serve the demo until Ctrl-C; drafter: a draft head folder (or "shipped") drafting every
    speculative decode of the shared engine."""
    from ..models import load_model
    from ..serve.app import run_beside
    from ..serve.engine import Engine
    from ..serve.engine import Request as EngineRequest

    model = load_model(model_name, weights)
    if model.name != "builtin":
        raise ValueError("the demo takes caption prompts; use --model builtin")
    from ..drafter.head import resolve_drafter

    engine = Engine(model, max_batch=QUEUE_LIMIT, queue_size=2 * QUEUE_LIMIT,
                    drafter=resolve_drafter(drafter, model))
    from ..serve.app import allowed_hosts

    run_beside(engine, create_app(model, engine, allowed_hosts(host, port)), host, port,
               banner=f"speculaas demo on http://{host}:{port}",
               warm=EngineRequest(prompt=None, method="csd"))
