"""The demo server under load (loopback only, bounded): every request gets an answer in time,
bad ones at once, and the page stays reachable while generations run."""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

GOOD = {"caption": "a small blue square on the right at sunset", "method": "csd", "window": 8,
        "compare": False}


def _post(url: str, body, timeout: float = 120.0) -> tuple[int, dict, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/api/generate", data=data,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


@pytest.mark.parametrize("body,message", [
    ({**GOOD, "compare": "false"}, "compare must be true or false"),
    ({**GOOD, "delta": "0.5"}, "delta must be a finite number"),
    ({**GOOD, "window": 16.5}, "window must be a whole number"),
    ({**GOOD, "seed": True}, "seed must be a whole number"),
    ({**GOOD, "caption": 7}, "caption must be text"),
    ({**GOOD, "coupling": "tight"}, "unknown coupling"),
    ({**GOOD, "caption": "a cat"}, "does not know"),
    ({**GOOD, "row_context": 40}, "row_context must be an integer in [1, 16]"),
    ({**GOOD, "row_context": "4"}, "row_context must be a whole number"),
    ({**GOOD, "row_context": 4, "method": "ar"}, "needs a speculative method"),
    ({**GOOD, "row_context": 4, "window": "auto"}, "fixed integer window"),
    (b"{not json", "could not read the request"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_requests_are_answered_400_at_once(demo_url, body, message):
    status, data, seconds = _post(demo_url, body)
    assert status == 400 and message in data["error"]
    assert seconds < 5


def test_twenty_concurrent_requests_all_answered_and_the_page_stays_up(demo_url):
    bodies = [({**GOOD, "seed": i} if i % 4 else {**GOOD, "delta": 7}) for i in range(20)]
    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [pool.submit(_post, demo_url, b) for b in bodies]
        time.sleep(0.5)  # generations are running now
        t0 = time.monotonic()
        with urllib.request.urlopen(demo_url + "/", timeout=10) as resp:
            assert resp.status == 200 and b"speculaas" in resp.read()
        page_seconds = time.monotonic() - t0
        answers = [f.result(timeout=180) for f in futures]
    assert page_seconds < 2.0, page_seconds
    codes = [status for status, _, _ in answers]
    assert set(codes) <= {200, 400, 503}, codes
    assert codes.count(400) == 5  # the five bad ones, whatever the load
    assert 1 <= codes.count(200) and codes.count(503) >= 1, codes
    for status, data, seconds in answers:
        if status == 503:
            assert seconds < 5 and "busy" in data["error"]
        if status == 200:
            assert data["runs"][0]["forward_passes"] < 256


def test_two_dimensional_window_through_the_page_api(demo_url):
    status, data, _ = _post(demo_url, {**GOOD, "row_context": 4, "compare": True})
    assert status == 200
    rows, ar = data["runs"]
    assert rows["method"] == "csd" and ar["method"] == "ar"
    assert rows["forward_passes"] < ar["forward_passes"] == 256


def test_concurrent_users_decode_together_and_draw_their_own_images(demo_url):
    """Requests in flight at once share the engine's batch, and each draws what it draws
    alone (csd at a fixed window: its own random stream)."""
    bodies = [{**GOOD, "seed": s} for s in (11, 12, 13)]
    alone = [_post(demo_url, b)[1]["runs"][0] for b in bodies[:1]]
    with ThreadPoolExecutor(max_workers=3) as pool:
        answers = [f.result(timeout=180)
                   for f in [pool.submit(_post, demo_url, b) for b in bodies]]
    assert all(status == 200 for status, _, _ in answers)
    runs = [data["runs"][0] for _, data, _ in answers]
    assert max(r["mean_batch"] for r in runs) > 1.0
    assert runs[0]["image"] == alone[0]["image"]
    assert runs[0]["forward_passes"] == alone[0]["forward_passes"]


def test_the_demo_takes_json_only_from_its_own_host(builtin):
    from fastapi.testclient import TestClient

    from speculaas.demo.app import create_app
    from speculaas.serve.app import allowed_hosts
    from speculaas.serve.engine import Engine

    engine = Engine(builtin, max_batch=2).start()
    try:
        app = create_app(builtin, engine, allowed_hosts("127.0.0.1", 7860))
        local = TestClient(app, base_url="http://127.0.0.1:7860")
        form = local.post("/api/generate", content=json.dumps(GOOD).encode(),
                          headers={"content-type": "text/plain"})
        assert form.status_code == 415  # what a page elsewhere can send without a preflight
        rebound = TestClient(app, base_url="http://attacker.example:7860")
        assert rebound.post("/api/generate", json=GOOD).status_code == 421
        assert local.post("/api/generate", json={**GOOD, "caption": "x" * 70_000}
                          ).status_code == 413
    finally:
        engine.stop()


def test_a_streamed_generation_shows_the_picture_so_far_then_the_result(builtin):
    from fastapi.testclient import TestClient

    from speculaas.demo.app import PREVIEWS, create_app
    from speculaas.serve.engine import Engine

    engine = Engine(builtin, max_batch=2).start()
    try:
        client = TestClient(create_app(builtin, engine))
        plain = client.post("/api/generate", json=GOOD).json()
        with client.stream("POST", "/api/generate", json={**GOOD, "stream": True}) as r:
            assert r.status_code == 200
            lines = [json.loads(line) for line in r.iter_lines() if line]
        bad = client.post("/api/generate", json={**GOOD, "stream": "yes"})
    finally:
        engine.stop()
    previews = [line for line in lines[:-1] if "preview" in line]
    assert len(previews) == len(lines) - 1 == PREVIEWS
    assert all(p["method"] == "csd" and p["preview"].startswith("data:image/png") for p in previews)
    assert lines[-1]["result"]["runs"][0]["image"] == plain["runs"][0]["image"]
    assert bad.status_code == 400 and "stream" in bad.json()["error"]
