"""`speculaas demo`: a local page that draws a caption with a method (and with AR on the same
seed) and shows where decoding sped up.

A FastAPI app: GET / serves the page, GET /api/config the model's defaults and limits,
POST /api/generate runs one request. Requests run one at a time (a lock), inputs are bounded so
no request can take the server down or run for minutes, and any bad value comes back as a
readable message.
"""


import base64
import io
import math
import threading
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..api import METHODS, generate
from ..bench.maps import run_lengths

LIMITS = {"caption_chars": 300, "window": (1, 64), "lam": (0.0, 10.0), "delta": (0.0, 1.0),
          "temperature": (0.05, 5.0), "cfg_scale": (0.0, 20.0), "seed": (0, 2**31 - 1)}
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
    raw = form.get(key, None)
    if raw in (None, ""):
        return default
    try:
        value = cast(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite, got {raw!r}")
    lo, hi = LIMITS[key]
    if not lo <= value <= hi:
        raise ValueError(f"{key} must be between {lo} and {hi}, got {value}")
    return value


def parse_request(form: dict, model) -> dict:  # noqa: ANN001
    """Validate a form into generate() arguments; raises ValueError with a readable message."""
    caption = str(form.get("caption", "")).strip()
    if not caption:
        raise ValueError("please enter a caption")
    if len(caption) > LIMITS["caption_chars"]:
        raise ValueError(f"the caption has {len(caption)} characters; the limit is "
                         f"{LIMITS['caption_chars']}")
    method = form.get("method", "csd")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    d = model.defaults
    args = {
        "method": method,
        "window": _number(form, "window", 16, int),
        "temperature": _number(form, "temperature", d.temperature),
        "cfg_scale": _number(form, "cfg_scale", d.cfg_scale or 1.0),
        "seed": _number(form, "seed", 0, int),
    }
    if method == "csd":
        args["lam"] = _number(form, "lam", 0.5)
        args["delta"] = _number(form, "delta", 0.65)
    model.check_prompts([caption])  # the model's own vocabulary check
    return {"caption": caption, "compare": bool(form.get("compare", False)), **args}


def run_request(model, req: dict) -> dict:  # noqa: ANN001
    caption, compare = req["caption"], req["compare"]
    args = {k: v for k, v in req.items() if k not in ("caption", "compare")}
    runs = [args] + ([{**args, "method": "ar", "lam": None, "delta": None}] if compare
                     and args["method"] != "ar" else [])
    results = []
    for r in runs:
        r = {k: v for k, v in r.items() if v is not None}
        out = generate(model, [caption], **r)
        steps = out.commit_step[0]
        runs_map = run_lengths(steps[None])[0].numpy()
        ent = out.entropy[0].numpy()
        n = out.tokens.shape[1]
        results.append({
            "method": r["method"],
            "image": _png(out.images[0]),
            "acceptance_map": _png(_heat(runs_map, 1, max(int(runs_map.max()), 2), "viridis")),
            "entropy_map": _png(_heat(ent, 0, max(float(ent.max()), 1e-3), "magma")),
            "forward_passes": int(out.forward_passes[0]),
            "tokens": n,
            "step_compression": round(n / int(out.forward_passes[0]), 2),
            "latency_s": round(out.latency_s, 3),
            "max_run": int(runs_map.max()),
        })
    return {"runs": results}


def create_app(model):  # noqa: ANN001, ANN201
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI(title="speculaas demo")
    lock = threading.Lock()

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    @app.get("/api/config")
    def config() -> dict:
        d = model.defaults
        return {"methods": list(METHODS), "examples": EXAMPLES, "limits": LIMITS,
                "defaults": {"window": 16, "temperature": d.temperature,
                             "cfg_scale": d.cfg_scale or 1.0, "lam": 0.5, "delta": 0.65,
                             "seed": 0},
                "model": model.name}

    @app.post("/api/generate")
    async def gen(request: Request):  # noqa: ANN202
        try:
            form = await request.json()
            if not isinstance(form, dict):
                raise ValueError("the request must be a JSON object")
            req = parse_request(form, model)
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except Exception:  # noqa: BLE001 - malformed JSON and the like
            return JSONResponse({"error": "could not read the request"}, status_code=400)
        with lock:
            try:
                with torch.inference_mode():
                    return run_request(model, req)
            except ValueError as e:
                return JSONResponse({"error": str(e)}, status_code=400)

    return app


def serve(model_name: str = "builtin", host: str = "127.0.0.1", port: int = 7860,
          weights: str | None = None) -> None:
    import uvicorn

    from ..models import load_model

    model = load_model(model_name, weights)
    if model.name != "builtin":
        raise ValueError("the demo takes caption prompts; use --model builtin")
    print(f"speculaas demo on http://{host}:{port}")
    uvicorn.run(create_app(model), host=host, port=port, log_level="warning")
