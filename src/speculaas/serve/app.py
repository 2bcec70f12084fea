"""`speculaas serve`: an OpenAI-style images endpoint over the continuous-batching engine.

    POST /v1/images/generations  {"prompt": "...", "n": 1, "response_format": "b64_json",
                                  "model": the served one, "size": "WxH" (a multiple of the
                                  model's own), + ours: "method" (default sjd: every image
                                  is AR's sample for its seed, whoever shares its batch),
                                  "seed", "window", "lam", "delta", "temperature", "top_k",
                                  "top_p", "cfg_scale"}
        -> {"created": ..., "data": [{"b64_json": PNG}], "speculaas": [per-image statistics]}
    GET  /health                 -> {"status": "ok" | "warming_up" (503), "waiting": ..., ...}
    GET  /metrics                -> Prometheus metrics (queue, rows in flight, committed tokens
                                    per image forward, iteration time, images by outcome)

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
from .engine import LOG, Cancelled, Completion, Engine, QueueFull, Request, ShuttingDown
from .http import HEADER_TIMEOUT_S, header_timeout_protocol

MAX_N = 8  # images per prompt
MAX_PROMPTS = 16  # prompts per call
MAX_IMAGES = 64  # images per call: they enter the engine as rows free up, not all at once
MAX_PARTIAL = 3  # previews per streamed image (OpenAI's images API allows 0 to 3)
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


def caller_policy(host: str, port: int, api_key: str | None) -> tuple[str | None, set[str] | None]:
    """(the API key: `api_key` or $SPECULAAS_API_KEY, the Host headers answered) of a server
    bound to host:port; warns on stderr when it is bound beyond loopback without a key."""
    import os
    import sys

    api_key = api_key or os.environ.get("SPECULAAS_API_KEY") or None
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"speculaas serve: warning: bound to {host}, beyond this machine, with no API key "
              "(--api-key or SPECULAAS_API_KEY): anyone who reaches it can use it",
              file=sys.stderr, flush=True)
    return api_key, allowed_hosts(host, port)


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
    """The requests of one API call: n images of each prompt (one string or a list), in that
    order, with seeds seed, seed + 1, ..., each with `time_limit_s` from now, queueing
    included; or ValueError."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    known = ("prompt", "n", "response_format", "stream", "partial_images", *DECODE_FIELDS,
             *CHECKED, *IGNORED, *RULE_OPTIONS)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; known: {', '.join(known)}")
    prompts = body.get("prompt")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not (isinstance(prompts, list) and 1 <= len(prompts) <= MAX_PROMPTS):
        raise ValueError(f"'prompt' must be a string or a list of 1 to {MAX_PROMPTS} strings")
    for prompt in prompts:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("each 'prompt' must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"a 'prompt' has {len(prompt)} characters; the limit is "
                             f"{MAX_PROMPT_CHARS}")
    n = body.get("n", 1)
    if not (is_integer(n) and 1 <= n <= MAX_N):
        raise ValueError(f"'n' must be an integer from 1 to {MAX_N}, got {n!r}")
    if len(prompts) * n > MAX_IMAGES:
        raise ValueError(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} images; the "
                         f"limit per call is {MAX_IMAGES}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"'stream' must be true or false, got {stream!r}")
    partial = body.get("partial_images", 0)
    if not (is_integer(partial) and 0 <= partial <= MAX_PARTIAL):
        raise ValueError(f"'partial_images' must be an integer from 0 to {MAX_PARTIAL}, got "
                         f"{partial!r}")
    if partial and not stream:
        raise ValueError("'partial_images' needs 'stream': true")
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
                    options=options, deadline=deadline, partial_images=partial, **sampling)
            for i, prompt in enumerate(p for p in prompts for _ in range(n))]


def _png(image: Image.Image, scale: int) -> str:
    if scale != 1:
        image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _stats(c: Completion) -> dict:
    return {"forward_passes": c.forward_passes,
            "step_compression": round(len(c.tokens) / c.forward_passes, 3),
            "windows": {str(w): k for w, k in c.windows.items()},
            "queue_s": round(c.queue_s, 4), "decode_s": round(c.decode_s, 4),
            "warmup_s": round(c.warmup_s, 4), "mean_batch": round(c.mean_batch, 2)}


class Call:
    """The images of one API call on their way through the engine. They enter the engine's
    queue as this call's earlier ones finish (at most `max_batch` at once), so a call of many
    images spreads over iterations and shares the queue with other calls instead of filling
    it; a client that leaves, or a time limit that runs out, cancels what is left."""

    def __init__(self, engine: Engine, reqs: list[Request], http) -> None:  # noqa: ANN001
        self.engine, self.reqs, self.http = engine, reqs, http
        self.next, self.pending = 0, {}
        self.done: list[Completion | None] = [None] * len(reqs)
        self.on_done = None  # (request, completion) as each image finishes

    def submit_more(self) -> None:
        """Queue this call's next images while fewer than max_batch of them are in; QueueFull
        only when none of them is (a full queue otherwise waits for our own to finish)."""
        room = min(len(self.reqs) - self.next, self.engine.max_batch - len(self.pending))
        if room <= 0:
            return
        try:
            futures = self.engine.submit_many(self.reqs[self.next : self.next + room])
        except QueueFull:
            if self.next == 0:  # nothing of this call is in: refused (503)
                raise
            return  # run() tries again as ours finish (and stops if the server drains)
        for future in futures:
            self.pending[asyncio.wrap_future(future)] = self.next
            self.next += 1

    async def run(self) -> list[Completion]:
        try:
            while self.pending or self.next < len(self.reqs):
                if not self.pending:  # the queue was full: try again shortly
                    await asyncio.sleep(0.1)
                    if self.engine.drain_until is not None:
                        raise Cancelled("the server is shutting down")
                    if time.monotonic() > self.reqs[self.next].deadline:
                        raise Cancelled("its time limit ran out")
                else:
                    finished, _ = await asyncio.wait(self.pending, timeout=0.25,
                                                     return_when=asyncio.FIRST_COMPLETED)
                    for future in finished:
                        index = self.pending.pop(future)
                        self.done[index] = future.result()
                        if self.on_done is not None:
                            self.on_done(self.reqs[index], self.done[index])
                if self.http is not None and await self.http.is_disconnected():
                    raise Cancelled("the client left")
                self.submit_more()
        except BaseException:
            self.cancel()
            raise
        return self.done

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()


def create_app(engine: Engine, time_limit_s: float = TIME_LIMIT_S,  # noqa: ANN201
               hosts: set[str] | None = None, api_key: str | None = None,
               replica: str | None = None):
    """The FastAPI app over `engine`. hosts: the Host headers it answers (allowed_hosts; None:
    any); api_key: required as Authorization: Bearer KEY where given; replica: this replica's
    id where several serve one application (serve/ray_app.py), in /health and in the
    x-speculaas-replica header of every answer."""
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
                "rows": engine.rows_in_flight(), "max_rows": engine.max_rows,
                "max_batch": engine.max_batch, "queue_size": engine.queue_size}
        if replica is not None:
            body["replica"] = replica
        return JSONResponse(body, status_code=503 if engine.warming else 200)

    @app.get("/metrics")
    def metrics():  # noqa: ANN202
        """Prometheus exposition of the engine's metrics (serve/metrics.py)."""
        from fastapi.responses import Response

        from .metrics import CONTENT_TYPE

        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/images/generations")
    async def generations(request: HTTPRequest):  # noqa: ANN202
        """One line in the access log per call: its id (also the x-request-id header), status,
        images, method, seconds, and the error's message where it failed."""
        from fastapi.responses import JSONResponse

        rid, t0, seen = uuid.uuid4().hex[:12], time.monotonic(), {}
        response = await _generate(request, seen)
        if isinstance(response, dict):
            response = JSONResponse(response)
        if response.status_code >= 400 and "queued" not in seen:
            engine.metrics.requests.labels("rejected").inc(seen.get("n", 1))
        line = (f"{rid} {response.status_code} n={seen.get('n', '-')} "
                f"method={seen.get('method', '-')} {time.monotonic() - t0:.2f}s")
        if response.status_code >= 400:
            line += " " + json.loads(response.body)["error"]["message"]
        ACCESS_LOG.info(line)
        response.headers["x-request-id"] = rid
        if replica is not None:
            response.headers["x-speculaas-replica"] = replica
        return response

    async def _generate(request: HTTPRequest, seen: dict):  # noqa: ANN202
        try:
            check_caller(request.headers, hosts, api_key)
            body = await read_json(request)
            reqs = parse(body, time_limit_s=time_limit_s)
            seen.update(n=len(reqs), method=reqs[0].method)
            scale = check_model_and_size(body, engine.model.name, native)
            for r in reqs:  # class ids, ids:1,2,3 (no files: those are the server's)
                r.prompt = parse_prompt(engine.model.name, r.prompt, files=False)
            # Building a rule can be heavy (lantern's neighbour table): off the event loop,
            # once per call (the images of a call share their setting).
            await asyncio.to_thread(lambda: (
                engine.check(reqs[0]), engine.model.check_prompts([r.prompt for r in reqs])))
        except Refused as e:
            return _error(str(e), e.status, code=e.code)
        except ModelNotFound as e:
            return _error(str(e), 404, code="model_not_found")
        except ValueError as e:
            return _error(str(e), 400)
        call = Call(engine, reqs, request)
        try:
            call.submit_more()  # the first image enters the queue, or the call is refused
        except QueueFull as e:
            message = (str(e) if isinstance(e, ShuttingDown)
                       else "the server's queue is full; try again in a few seconds")
            return _error(message, 503, "server_busy")
        seen["queued"] = True  # from here on the engine counts each image's outcome
        if body.get("stream", False):
            from fastapi.responses import StreamingResponse

            return StreamingResponse(_events(call, scale), media_type="text/event-stream")
        try:
            done = await call.run()
        except Cancelled as e:
            return _error(f"stopped: {e}", 503, "server_busy")
        except ValueError as e:
            return _error(str(e), 400)
        except Exception as e:  # noqa: BLE001 - logged by the engine; the client hears why
            return _error(f"the server failed: {type(e).__name__}: {e}", 500, "server_error")
        return {"created": int(time.time()),
                "data": [{"b64_json": _png(c.image, scale)} for c in done],
                "speculaas": [_stats(c) for c in done]}

    async def _events(call: Call, scale: int):  # noqa: ANN202
        """Server-sent events as OpenAI's images API streams them: partial images
        (image_generation.partial_image) while rows commit, then each image
        (image_generation.completed); `image_index` (ours) says which image of the call."""
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_partial(req: Request, index: int, image: Image.Image) -> None:  # engine thread
            loop.call_soon_threadsafe(events.put_nowait, ("partial", req, index, image))

        for r in call.reqs:
            r.on_partial = on_partial
        call.on_done = lambda req, c: events.put_nowait(("done", req, 0, c))
        task = asyncio.ensure_future(call.run())
        position = {id(r): i for i, r in enumerate(call.reqs)}
        try:
            while not (task.done() and events.empty()):
                try:
                    kind, req, index, item = await asyncio.wait_for(events.get(), 0.25)
                except TimeoutError:
                    continue
                data = {"created_at": int(time.time()), "image_index": position[id(req)],
                        "output_format": "png"}
                if kind == "partial":
                    image = item
                    data.update(type="image_generation.partial_image", partial_image_index=index,
                                b64_json=_png(image, scale))
                else:
                    image = item.image
                    data.update(type="image_generation.completed", b64_json=_png(image, scale),
                                speculaas=_stats(item))
                data["size"] = f"{image.width * scale}x{image.height * scale}"
                yield f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"
            task.result()
        except Exception as e:  # noqa: BLE001 - the stream ends with the error, not silence
            message = (f"stopped: {e}" if isinstance(e, Cancelled)
                       else str(e) if isinstance(e, ValueError)
                       else f"the server failed: {type(e).__name__}: {e}")
            error = {"type": "error", "error": {"message": message, "type": "server_error"}}
            yield f"event: error\ndata: {json.dumps(error)}\n\n"
        finally:
            task.cancel()
            call.cancel()

    return app


def serve(model_name: str = "builtin", host: str = "127.0.0.1", port: int = 8000,
          weights: str | None = None, max_batch: int = 8, queue_size: int = 64,
          time_limit_s: float = TIME_LIMIT_S, warm_up_s: float = 120.0,
          api_key: str | None = None, drafter: str | None = None,
          header_timeout_s: float = HEADER_TIMEOUT_S, model_options: dict | None = None,
          max_rows: int | None = None) -> None:
    """Serve until Ctrl-C; first measure the default setting's cost curves for at most
    `warm_up_s` seconds (0: none; /health answers 503 "warming_up" meanwhile). api_key (or
    $SPECULAAS_API_KEY): required of every generation call. drafter: a draft head folder (or
    "shipped") drafting every speculative request. header_timeout_s: a connection's request
    head must be complete this many seconds after it opens (or after its last response).
    model_options: the adapter's options (device, dtype, vq=, grid=, ...; load_model).
    max_rows: sample rows in flight (a guided image is two; default 2 x max_batch)."""

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
    if max_rows is not None and not 1 <= max_rows <= 2 * MAX_BATCH:
        raise ValueError(f"--max-rows must be from 1 to {2 * MAX_BATCH}, got {max_rows}")
    api_key, hosts = caller_policy(host, port, api_key)
    model = load_model(model_name, weights, **(model_options or {}))
    from ..drafter.head import resolve_drafter

    head = resolve_drafter(drafter, model)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    LOG.addHandler(handler)  # the engine's errors and, below it, the access log
    LOG.setLevel(logging.INFO)
    engine = Engine(model, max_batch=max_batch, queue_size=queue_size, drafter=head,
                    max_rows=max_rows)
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
