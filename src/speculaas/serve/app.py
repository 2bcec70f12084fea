"""`speculaas serve`: an OpenAI-style images endpoint over the continuous-batching engine.

    POST /v1/images/generations  {"prompt": "...", "n": 1, "response_format": "b64_json",
                                  "model": the served one, "size": "WxH" (a multiple of the
                                  model's own), + ours: "method" (default sjd: every image
                                  is AR's sample for its seed, whoever shares its batch),
                                  "seed", "window", "lam", "delta", "temperature", "top_k",
                                  "top_p", "cfg_scale"}
        -> {"created": ..., "data": [{"b64_json": PNG}], "speculaas": [per-image statistics]}
    GET  /health                 -> {"status": "ok" | "warming_up" (503), "waiting": ..., ...}

Bad requests get 400 with OpenAI's error shape ({"error": {"message", "type", "code"}}), an
unknown model 404 model_not_found, a full queue 503 (Retry-After); a request whose client
leaves, or whose time limit runs out, leaves the batch within one iteration. Every call gets an
id (the x-request-id header) and one line in the access log.
"""


import asyncio
import base64
import io
import json
import logging
import signal
import time
import uuid

import torch
from PIL import Image

from ..checks import is_integer, is_number
from ..config import METHODS, RULE_DEFAULTS
from ..prompting import parse_prompt
from .engine import LOG, Cancelled, Engine, QueueFull, Request, ShuttingDown
from .http import HEADER_TIMEOUT_S, header_timeout_protocol

MAX_N = 8
MAX_PROMPT_CHARS = 1000
TIME_LIMIT_S = 300.0
DRAIN_S = 30.0  # on SIGTERM, how long running requests may take to finish
# One line per API call (serve() sends it to stderr with a time stamp): what an operator needs to
# answer "what happened to request X" (the client sees X as the x-request-id header).
ACCESS_LOG = logging.getLogger("speculaas.serve.access")
# Our fields beside OpenAI's, and the rule options of every method (config.RULE_DEFAULTS).
DECODE_FIELDS = ("method", "seed", "window", "temperature", "top_k", "top_p", "cfg_scale")
RULE_OPTIONS = tuple(sorted({k for opts in RULE_DEFAULTS.values() for k in opts}))
# OpenAI fields we read beside the prompt: the model must be the one this server loaded (else
# 404 model_not_found, as OpenAI answers), the size a square multiple of the model's own
# (upscaled by nearest neighbour, as the CLI's --scale); the rest are accepted and ignored.
CHECKED = ("model", "size")
IGNORED = ("user", "quality", "style")
MAX_SIDE = 2048


MAX_BODY_BYTES = 64 * 1024  # a prompt of MAX_PROMPT_CHARS and every option fit many times over
MAX_BATCH, MAX_QUEUE = 256, 100_000  # bounds of --max-batch and --queue


class ModelNotFound(ValueError):
    """The request names a model this server does not serve."""


class Refused(Exception):
    """A call refused before any work, with its HTTP status (and OpenAI error code)."""

    def __init__(self, message: str, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def allowed_hosts(host: str, port: int) -> set[str] | None:
    """The Host headers a client of a server bound to host:port sends (a page elsewhere that
    rebinds its own name to this address sends its own name, and is refused); None: any (a
    server bound to every interface is reached under names it cannot know)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    names = {host}
    if host in ("127.0.0.1", "localhost", "::1"):
        names = {"127.0.0.1", "localhost", "[::1]"}
    return names | {f"{n}:{port}" for n in names}


def check_caller(headers, hosts: set[str] | None, api_key: str | None) -> None:  # noqa: ANN001
    """Refused unless the Host header is one of `hosts` (None: any) and, with an `api_key`,
    the Authorization header carries it (as OpenAI's clients send it: Bearer KEY)."""
    if hosts is not None and headers.get("host", "").lower() not in hosts:
        raise Refused(f"this server does not answer to host {headers.get('host')!r}", 421)
    if api_key is not None:
        import hmac

        sent = headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise Refused("a valid API key is required (Authorization: Bearer KEY)", 401,
                          "invalid_api_key")


async def read_json(request, limit: int = MAX_BODY_BYTES) -> object:  # noqa: ANN001
    """The body as JSON: only as application/json (a form or text/plain post from a web page
    is refused, so no page can make this server work without a preflight), at most `limit`
    bytes (refused before more is read)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise Refused(f"the body must be sent as application/json, not {kind or 'untyped'}",
                      415)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(f"the body has {length} bytes; the limit is {limit}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Refused(f"the body is over the limit of {limit} bytes", 413)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("the request body is not valid JSON") from None


def check_model_and_size(body: dict, served: str, native: tuple[int, int]) -> int:
    """The upscale factor the request's "size" asks for (1 without one), or ModelNotFound /
    ValueError naming what is valid."""
    model = body.get("model")
    if model is not None and model != served:
        raise ModelNotFound(f"the model {model!r} does not exist here; this server serves "
                            f"{served!r}")
    size = body.get("size")
    if size is None or size == "auto":
        return 1
    w, h = native
    valid = [f"{w * k}x{h * k}" for k in range(1, MAX_SIDE // max(w, h) + 1)]
    if size not in valid:
        shown = ", ".join(valid[:4] + (["...", valid[-1]] if len(valid) > 4 else []))
        raise ValueError(f"'size' must be 'auto' or a multiple of the model's {w}x{h}: "
                         f"{shown}; got {size!r}")
    return valid.index(size) + 1


def _error(message: str, status: int, kind: str = "invalid_request_error",  # noqa: ANN202
           code: str | None = None):
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": "5"} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}}, status_code=status, headers=headers)


def parse(body: object, default_method: str = "sjd",
          time_limit_s: float = TIME_LIMIT_S) -> list[Request]:
    """The requests of one API call (n images, seeds seed .. seed + n - 1, each with
    `time_limit_s` from now, queueing included), or ValueError."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    known = ("prompt", "n", "response_format", *DECODE_FIELDS, *CHECKED, *IGNORED,
             *RULE_OPTIONS)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; known: {', '.join(known)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("'prompt' must be a non-empty string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"'prompt' has {len(prompt)} characters; the limit is "
                         f"{MAX_PROMPT_CHARS}")
    n = body.get("n", 1)
    if not (is_integer(n) and 1 <= n <= MAX_N):
        raise ValueError(f"'n' must be an integer from 1 to {MAX_N}, got {n!r}")
    fmt = body.get("response_format", "b64_json")
    if fmt != "b64_json":
        raise ValueError(f"'response_format' must be 'b64_json' (this server keeps no image "
                         f"URLs), got {fmt!r}")
    method = body.get("method", default_method)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    seed = body.get("seed", 0)
    if not (is_integer(seed) and 0 <= seed < 2**62):
        raise ValueError(f"'seed' must be an integer in [0, 2**62), got {seed!r}")
    window = body.get("window", "auto")
    if window is None:
        window = "auto"
    allowed = RULE_DEFAULTS.get(method, {})
    options = {}
    for key in RULE_OPTIONS:
        if key in body and body[key] is not None:
            if key not in allowed:
                raise ValueError(f"'{key}' is not an option of {method}")
            options[key] = body[key]
    sampling = {k: body.get(k) for k in ("temperature", "top_k", "top_p", "cfg_scale")}
    for key, value in sampling.items():
        if value is not None and not is_number(value):
            raise ValueError(f"'{key}' must be a number, got {value!r}")
    deadline = time.monotonic() + time_limit_s
    return [Request(prompt=prompt, seed=int(seed) + i, method=method, window=window,
                    options=options, deadline=deadline, **sampling) for i in range(n)]


def create_app(engine: Engine, time_limit_s: float = TIME_LIMIT_S,  # noqa: ANN201
               hosts: set[str] | None = None, api_key: str | None = None):
    """The FastAPI app over `engine`. hosts: the Host headers it answers (allowed_hosts; None:
    any); api_key: required as Authorization: Bearer KEY where given."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest

    app = FastAPI(title="speculaas images API")
    length = engine.model.layout.length
    native = engine.model.decode(torch.zeros(1, length, dtype=torch.long,
                                             device=engine.model.device))[0].size

    @app.get("/health")
    def health():  # noqa: ANN202
        from fastapi.responses import JSONResponse

        running = sum(r is not None for lane in list(engine.lanes.values()) for r in lane.slots)
        body = {"status": "warming_up" if engine.warming else "ok", "model": engine.model.name,
                "waiting": len(engine.waiting), "running": running,
                "max_batch": engine.max_batch, "queue_size": engine.queue_size}
        return JSONResponse(body, status_code=503 if engine.warming else 200)

    @app.post("/v1/images/generations")
    async def generations(request: HTTPRequest):  # noqa: ANN202
        """One line in the access log per call: its id (also the x-request-id header), status,
        images, method, seconds, and the error's message where it failed."""
        from fastapi.responses import JSONResponse

        rid, t0, seen = uuid.uuid4().hex[:12], time.monotonic(), {}
        response = await _generate(request, seen)
        if isinstance(response, dict):
            response = JSONResponse(response)
        line = (f"{rid} {response.status_code} n={seen.get('n', '-')} "
                f"method={seen.get('method', '-')} {time.monotonic() - t0:.2f}s")
        if response.status_code >= 400:
            line += " " + json.loads(response.body)["error"]["message"]
        ACCESS_LOG.info(line)
        response.headers["x-request-id"] = rid
        return response

    async def _generate(request: HTTPRequest, seen: dict):  # noqa: ANN202
        try:
            check_caller(request.headers, hosts, api_key)
            body = await read_json(request)
            reqs = parse(body, time_limit_s=time_limit_s)
            seen.update(n=len(reqs), method=reqs[0].method)
            if len(reqs) > engine.queue_size:
                raise ValueError(f"'n' is {len(reqs)}, more than this server's queue holds "
                                 f"({engine.queue_size}); send at most {engine.queue_size} "
                                 "per call")
            scale = check_model_and_size(body, engine.model.name, native)
            for r in reqs:  # class ids, ids:1,2,3 (no files: those are the server's)
                r.prompt = parse_prompt(engine.model.name, r.prompt, files=False)
            # Building a rule can be heavy (lantern's neighbour table): off the event loop.
            await asyncio.to_thread(lambda: [engine.check(r) for r in reqs])
        except Refused as e:
            return _error(str(e), e.status, code=e.code)
        except ModelNotFound as e:
            return _error(str(e), 404, code="model_not_found")
        except ValueError as e:
            return _error(str(e), 400)
        if len(engine.waiting) + len(reqs) > engine.queue_size:
            return _error("the server's queue is full; try again in a few seconds", 503,
                          "server_busy")
        futures = []
        try:
            for r in reqs:
                futures.append(asyncio.wrap_future(engine.submit(r)))
        except QueueFull as e:
            for r in reqs:
                r.cancel()
            message = (str(e) if isinstance(e, ShuttingDown)
                       else "the server's queue is full; try again in a few seconds")
            return _error(message, 503, "server_busy")
        try:
            pending = set(futures)
            while pending:  # a client that leaves cancels its images
                _, pending = await asyncio.wait(pending, timeout=0.25)
                if pending and await request.is_disconnected():
                    for r in reqs:
                        r.cancel()
            done = [f.result() for f in futures]
        except Cancelled as e:
            for r in reqs:
                r.cancel()
            return _error(f"stopped: {e}", 503, "server_busy")
        except ValueError as e:
            return _error(str(e), 400)
        except Exception as e:  # noqa: BLE001 - logged by the engine; the client hears why
            return _error(f"the server failed: {type(e).__name__}: {e}", 500, "server_error")
        data, stats = [], []
        for c in done:
            buf = io.BytesIO()
            image = c.image if scale == 1 else c.image.resize(
                (c.image.width * scale, c.image.height * scale), Image.NEAREST)
            image.save(buf, format="PNG")
            data.append({"b64_json": base64.b64encode(buf.getvalue()).decode()})
            n_tokens = len(c.tokens)
            stats.append({"forward_passes": c.forward_passes,
                          "step_compression": round(n_tokens / c.forward_passes, 3),
                          "windows": {str(w): k for w, k in c.windows.items()},
                          "queue_s": round(c.queue_s, 4), "decode_s": round(c.decode_s, 4),
                          "warmup_s": round(c.warmup_s, 4),
                          "mean_batch": round(c.mean_batch, 2)})
        return {"created": int(time.time()), "data": data, "speculaas": stats}

    return app


def serve(model_name: str = "builtin", host: str = "127.0.0.1", port: int = 8000,
          weights: str | None = None, max_batch: int = 8, queue_size: int = 64,
          time_limit_s: float = TIME_LIMIT_S, warm_up_s: float = 120.0,
          api_key: str | None = None, drafter: str | None = None,
          header_timeout_s: float = HEADER_TIMEOUT_S, model_options: dict | None = None) -> None:
    """Serve until Ctrl-C; first measure the default setting's cost curves for at most
    `warm_up_s` seconds (0: none; /health answers 503 "warming_up" meanwhile). api_key (or
    $SPECULAAS_API_KEY): required of every generation call. drafter: a draft head folder (or
    "shipped") drafting every speculative request. header_timeout_s: a connection's request
    head must be complete this many seconds after it opens (or after its last response).
    model_options: the adapter's options (device, dtype, vq=, grid=, ...; load_model)."""
    import os
    import sys

    from ..models import load_model

    if not 0 < header_timeout_s <= 3600:
        raise ValueError(f"--header-timeout must be in (0, 3600] seconds, got {header_timeout_s}")
    if not time_limit_s > 0 or not warm_up_s >= 0:
        raise ValueError(f"--time-limit must be > 0 and --warm-up >= 0 seconds, got "
                         f"{time_limit_s}, {warm_up_s}")
    if not 0 < port < 65536:
        raise ValueError(f"--port must be from 1 to 65535, got {port}")
    if not (1 <= max_batch <= MAX_BATCH and 1 <= queue_size <= MAX_QUEUE):
        raise ValueError(f"--max-batch must be from 1 to {MAX_BATCH} and --queue from 1 to "
                         f"{MAX_QUEUE}, got {max_batch}, {queue_size}")
    api_key = api_key or os.environ.get("SPECULAAS_API_KEY") or None
    hosts = allowed_hosts(host, port)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"speculaas serve: warning: bound to {host}, beyond this machine, with no API key "
              "(--api-key or SPECULAAS_API_KEY): anyone who reaches it can use it",
              file=sys.stderr, flush=True)
    model = load_model(model_name, weights, **(model_options or {}))
    from ..drafter.head import resolve_drafter

    head = resolve_drafter(drafter, model)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    LOG.addHandler(handler)  # the engine's errors and, below it, the access log
    LOG.setLevel(logging.INFO)
    engine = Engine(model, max_batch=max_batch, queue_size=queue_size, drafter=head)
    warm = Request(prompt=None, method="sjd") if warm_up_s > 0 else None
    run_beside(engine, create_app(engine, time_limit_s, hosts, api_key), host, port, warm=warm,
               warm_up_s=warm_up_s, header_timeout_s=header_timeout_s)


def run_beside(engine: Engine, app, host: str, port: int, banner: str | None = None,  # noqa: ANN001
               warm: Request | None = None, warm_up_s: float = 120.0,
               header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """The HTTP server on a thread, the engine on this (the main) thread, until Ctrl-C or the
    server stops (Engine.serve_forever says why the engine takes the main thread); uvicorn
    leaves signals alone off the main thread, so Ctrl-C interrupts the engine here. warm: the
    setting whose cost curves the engine measures before it serves (Engine.warm_up).
    header_timeout_s: a connection's request head must be complete within it (serve/http.py)."""
    import threading

    import uvicorn

    if warm is not None:
        engine.warming = True  # /health says so from its first answer

    def on_term(signum, frame) -> None:  # noqa: ANN001 - only sets a flag: signal-safe
        engine.drain(DRAIN_S)

    signal.signal(signal.SIGTERM, on_term)  # before the first request can arrive
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           http=header_timeout_protocol(header_timeout_s)))
    thread = threading.Thread(target=server.run, name="speculaas-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not thread.is_alive():
        raise ValueError(f"could not serve on {host}:{port} (in use?)")
    print(banner or f"speculaas serve: {engine.model.name} on http://{host}:{port}/v1 (max "
          f"batch {engine.max_batch}, queue {engine.queue_size}); POST /v1/images/generations, "
          "GET /health", flush=True)
    watcher = threading.Thread(target=lambda: (thread.join(), engine.stop()), daemon=True)
    watcher.start()
    try:
        engine.serve_forever(warm, warm_up_s)
        if engine.drain_until is not None:
            LOG.info("SIGTERM: stopped taking requests, answered every one, exiting")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
