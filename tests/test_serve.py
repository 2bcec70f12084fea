"""`speculaas serve` and its engine: continuous batching gives every request the image a solo
generate() call gives its seed (sjd at any window; csd at a fixed one) while the batch changes
under it; a cancelled request frees its row within one iteration; the OpenAI client talks to
a live server on loopback; bad requests get 400, a full queue 503."""

import base64
import contextlib
import io

import pytest
import torch
from conftest import serve_process
from PIL import Image

import speculaas as sp
from speculaas.serve.engine import Cancelled, Engine, QueueFull, Request

PROMPTS = [(3, 5), (None, 6), (7, 7), (1, 8), (2, 9), (0, 10)]


@pytest.mark.parametrize("method,window,options", [
    ("sjd", "auto", {}), ("sjd", 6, {}), ("csd", 4, {"delta": 0.8}), ("ar", "auto", {})])
def test_requests_joining_mid_decode_draw_what_solo_calls_draw(tiny, method, window, options):
    engine = Engine(tiny, max_batch=3)
    reqs = [Request(prompt=p, seed=s, method=method, window=window, options=options)
            for p, s in PROMPTS]
    futures = [engine.submit(r) for r in reqs[:2]]
    engine.run_once()
    engine.run_once()
    futures += [engine.submit(r) for r in reqs[2:]]  # three wait for a free row
    while engine.run_once():
        pass
    assert len(set(engine.batch_log)) > 1 and max(engine.batch_log) == 3  # the batch changed
    for r, f in zip(reqs, futures, strict=True):
        solo = sp.generate(tiny, [r.prompt], method=method, seed=r.seed,
                           window=None if method == "ar" else window, decode_images=False,
                           **options)
        done = f.result()
        assert torch.equal(done.tokens, solo.tokens[0]), r
        if window != "auto":
            assert done.forward_passes == int(solo.forward_passes[0])
    # the negative control: another seed draws another image
    other = sp.generate(tiny, [reqs[0].prompt], method="ar", seed=99, decode_images=False)
    assert not torch.equal(futures[0].result().tokens, other.tokens[0])


T_HOT = 8.0


@pytest.fixture(scope="module", params=["llamagen", "janus", "emu3", "lumina-mgpt"])
def adapter(request, tmp_path_factory):
    from speculaas.models.random_checkpoints import write_random_checkpoint

    ckpt = write_random_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return ckpt.load(), ckpt.prompts


@pytest.mark.parametrize("method,window", [("sjd", 4), ("sjd", "auto"), ("ar", "auto")])
def test_every_adapter_admits_requests_into_a_running_batch(adapter, method, window):
    """Each real-model adapter's tiny checkpoint, with its recipe's guidance: a request joining
    a running batch, and one taking over a finished request's row, draw what solo generate()
    calls draw for their seeds (a high temperature: the random weights are sharp, and seeds
    must draw different images for the comparison to mean anything)."""
    model, prompts = adapter
    engine = Engine(model, max_batch=2)
    reqs = [Request(prompt=prompts[i % len(prompts)], seed=10 + i, window=window,
                    temperature=T_HOT, method=method) for i in range(4)]  # ar: one-token steps
    futures = [engine.submit(reqs[0])]
    engine.run_once()
    futures += [engine.submit(r) for r in reqs[1:]]  # one joins, two wait for a row
    while engine.run_once():
        pass
    assert max(engine.batch_log) == 2
    for r, f in zip(reqs, futures, strict=True):
        solo = sp.generate(model, [r.prompt], method="sjd", seed=r.seed, window=window,
                           temperature=T_HOT, decode_images=False)
        assert torch.equal(f.result().tokens, solo.tokens[0]), (model.name, r.seed)
    other = sp.generate(model, [reqs[0].prompt], method="ar", seed=99, temperature=T_HOT,
                        decode_images=False)
    assert not torch.equal(futures[0].result().tokens, other.tokens[0])


def test_the_cli_serves_a_real_adapter(tmp_path):
    """`speculaas serve --model llamagen` on a tiny LlamaGen checkpoint (its options as
    --model-opt): the served image is the one generate() draws for the seed."""
    import json

    import httpx

    from speculaas.models.random_checkpoints import write_random_checkpoint

    ckpt = write_random_checkpoint("llamagen", tmp_path)
    opts = [a for k, v in ckpt.options.items()
            for a in ("--model-opt", f"{k}={json.dumps(v) if isinstance(v, dict) else v}")]
    with serve_process("--model", "llamagen", "--weights", ckpt.path, *opts) as url:
        r = httpx.post(f"{url}/v1/images/generations", timeout=60,
                       json={"prompt": "3", "seed": 5, "temperature": T_HOT, "window": 4})
    assert r.status_code == 200, r.text
    served = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    solo = sp.generate(ckpt.load(), [3], method="sjd", seed=5, temperature=T_HOT)
    assert served.tobytes() == solo.images[0].tobytes()


def test_a_cancelled_request_frees_its_row_within_one_iteration(tiny):
    engine = Engine(tiny, max_batch=2)
    a, b, c = (Request(prompt=p, seed=s, window=2) for p, s in PROMPTS[:3])
    fa, fb, fc = engine.submit(a), engine.submit(b), engine.submit(c)
    engine.run_once()
    a.cancel()
    engine.run_once()  # a leaves, c takes its row in the same call
    lane = next(iter(engine.lanes.values()))
    assert c in lane.slots and a not in lane.slots
    with pytest.raises(Cancelled):
        fa.result()
    while engine.run_once():
        pass
    assert fb.result().forward_passes > 0 and fc.result().forward_passes > 0


def test_a_failed_admission_fails_its_request_and_leaves_the_row_free(tiny, monkeypatch):
    from speculaas.decoding.loop import Loop

    engine = Engine(tiny, max_batch=2)
    a, b = (Request(prompt=p, seed=s, window=2) for p, s in PROMPTS[:2])
    fb = engine.submit(b)
    engine.run_once()  # b decodes in row 0
    real = Loop.restart

    def restart(self, rows, generators):  # noqa: ANN001, ANN202
        real(self, rows, generators)  # the row is reset, then something fails
        raise RuntimeError("admission failed")

    monkeypatch.setattr(Loop, "restart", restart)
    fa = engine.submit(a)
    engine.run_once()  # a fails in row 1
    monkeypatch.setattr(Loop, "restart", real)
    with pytest.raises(RuntimeError, match="admission failed"):
        fa.result()
    lane = next(iter(engine.lanes.values()))
    state = lane.loop.state
    assert lane.free() == [1] and int(state.count[1]) == state.length  # free: finished
    while engine.run_once():
        pass
    solo = sp.generate(tiny, [b.prompt], method="sjd", seed=b.seed, window=2,
                       decode_images=False)
    assert torch.equal(fb.result().tokens, solo.tokens[0])


def test_queue_and_bad_requests(tiny):
    engine = Engine(tiny, max_batch=1, queue_size=2)
    engine.submit(Request(prompt=1))
    engine.submit(Request(prompt=2))
    with pytest.raises(QueueFull):
        engine.submit(Request(prompt=3))
    with pytest.raises(ValueError, match="unknown method"):
        engine.submit(Request(prompt=1, method="fast"))
    with pytest.raises(ValueError, match="window"):
        engine.submit(Request(prompt=1, window=0))
    with pytest.raises(ValueError, match="cannot admit"):
        sp.load_model("toy").admit(None, [0], [None])


@pytest.fixture(scope="module")
def server():
    with serve_process("--model", "tiny", "--max-batch", "4", "--queue", "3") as url:
        yield url


def test_the_openai_client_generates_an_image(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    res = client.images.generate(model="tiny", prompt="3", n=2, response_format="b64_json",
                                 extra_body={"seed": 4, "method": "sjd", "window": 6})
    assert len(res.data) == 2
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in res.data]
    assert images[0].size == images[1].size and images[0].size[0] > 0
    with pytest.raises(BadRequestError, match="unknown method"):
        client.images.generate(model="tiny", prompt="3", extra_body={"method": "fast"})
    with pytest.raises(BadRequestError, match="response_format"):
        client.images.generate(model="tiny", prompt="3", response_format="url")


def test_the_model_must_be_served_and_the_size_is_honoured(server):
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match="dall-e-3") as e:
        client.images.generate(model="dall-e-3", prompt="3")
    assert e.value.body["code"] == "model_not_found"
    native = client.images.generate(model="tiny", prompt="3", extra_body={"window": 4})
    small = Image.open(io.BytesIO(base64.b64decode(native.data[0].b64_json)))
    side = small.width
    big = client.images.generate(model="tiny", prompt="3", size=f"{3 * side}x{3 * side}",
                                 extra_body={"window": 4})
    image = Image.open(io.BytesIO(base64.b64decode(big.data[0].b64_json)))
    assert image.size == (3 * side, 3 * side)
    assert image.resize(small.size, Image.NEAREST).tobytes() == small.tobytes()
    with pytest.raises(BadRequestError, match="multiple of the model's"):
        client.images.generate(model="tiny", prompt="3", size=f"{side + 1}x{side + 1}")


def test_the_server_answers_400_and_503_and_keeps_serving(server):
    import httpx

    gen = f"{server}/v1/images/generations"
    bad = httpx.post(gen, json={"prompt": "3", "n": 0})
    assert bad.status_code == 400 and "'n'" in bad.json()["error"]["message"]
    bad = httpx.post(gen, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    more = httpx.post(gen, json={"prompt": ["3", "4"], "n": 8, "seed": 2, "window": 4},
                      timeout=120)  # 16 images through a queue of 3: they enter as rows free
    assert more.status_code == 200 and len(more.json()["data"]) == 16
    too_many = httpx.post(gen, json={"prompt": ["3"] * 9, "n": 8})
    assert too_many.status_code == 400 and "limit per call" in too_many.json()["error"]["message"]
    ok = httpx.post(gen, json={"prompt": "3", "seed": 1, "window": 4}, timeout=60)
    assert ok.status_code == 200
    stats = ok.json()["speculaas"][0]
    assert stats["forward_passes"] > 0 and stats["windows"] == {"4": stats["forward_passes"]}
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def fresh_tiny():  # a model object no other test has timed
    return sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)


def test_a_future_cancelled_from_outside_retires_its_row_and_fails_nobody(tiny):
    engine = Engine(tiny, max_batch=2)
    a, b = (Request(prompt=p, seed=s, method="csd", window=4) for p, s in PROMPTS[:2])
    fa, fb = engine.submit(a), engine.submit(b)
    engine.run_once()
    engine.run_once()  # a leaves drafts waiting in its row (a reset must clear them)
    assert fa.cancel()  # what asyncio.wait_for does to the request when the client's time runs out
    engine.run_once()
    lane = next(iter(engine.lanes.values()))
    assert a not in lane.slots and engine.batch_log[-1] == 1  # its row costs no more forwards
    # csd in the freed row: a new request draws what it draws alone (no drafts left behind).
    c = Request(prompt=PROMPTS[2][0], seed=PROMPTS[2][1], method="csd", window=4)
    fc = engine.submit(c)
    while engine.run_once():
        pass
    solo = sp.generate(tiny, [c.prompt], method="csd", seed=c.seed, window=4,
                       decode_images=False)
    assert torch.equal(fc.result().tokens, solo.tokens[0])
    assert fb.result().forward_passes > 0


def test_two_settings_in_one_engine_each_draw_their_own(tiny):
    engine = Engine(tiny, max_batch=2)
    reqs = [Request(prompt=3, seed=5, window=4, top_k=2), Request(prompt=3, seed=5, window=4),
            Request(prompt=3, seed=5, window=4, method="csd", options={"delta": 0.8})]
    futures = [engine.submit(r) for r in reqs]
    while engine.run_once():
        pass
    for r, f in zip(reqs, futures, strict=True):
        solo = sp.generate(tiny, [r.prompt], method=r.method, seed=r.seed, window=4,
                           top_k=r.top_k, decode_images=False, **r.options)
        assert torch.equal(f.result().tokens, solo.tokens[0]), r
    assert not torch.equal(futures[0].result().tokens, futures[1].result().tokens)


def test_lanes_are_bounded_whatever_settings_clients_send(tiny):
    engine = Engine(tiny, max_batch=2, idle_lanes=1, max_lanes=3)
    futures = [engine.submit(Request(prompt=1, seed=0, window=2, temperature=1.0 + i / 100))
               for i in range(7)]
    peak = 0
    while engine.run_once():
        peak = max(peak, len(engine.lanes))
    assert all(f.result().forward_passes > 0 for f in futures)
    assert peak == 3 and len(engine.lanes) == 1  # three at once; one idle lane is kept


def _rss_mb() -> float:
    """Resident memory after glibc hands freed heap pages back (malloc_trim): without the trim
    RSS also counts freed memory the allocator keeps, which varied 36-190 MB between machines
    for the same live lanes."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="Linux /proc")
def test_memory_stays_bounded_whatever_settings_clients_send():
    """Each distinct setting (here the temperature's 4th decimal) needs a lane (KV rows and a
    noise table: 8 MB for a 16 x 16 grid of 4096 codes): the engine's process memory stops
    growing once its lanes are at their bound, where an engine that keeps every lane grows
    with each one."""
    model = sp.load_model("tiny", vocab_size=4096, grid=(16, 16), num_classes=4, d_model=32,
                          n_layers=2, n_heads=2)

    def growth(**bounds) -> tuple[float, int]:
        engine = Engine(model, max_batch=2, **bounds)

        def run(settings) -> None:
            futures = [engine.submit(Request(prompt=1, seed=0, window=16,
                                             temperature=1.0 + t / 10_000)) for t in settings]
            while engine.run_once():
                pass
            assert all(f.result().forward_passes > 0 for f in futures)

        run(range(3))  # warm: the bound's lanes exist, allocator pools are filled
        before = _rss_mb()
        run(range(3, 8))
        return _rss_mb() - before, len(engine.lanes)

    bounded, lanes = growth(idle_lanes=1, max_lanes=2)
    unbounded, kept = growth(idle_lanes=64, max_lanes=64)  # the control: nothing is freed
    assert lanes == 1 and kept == 8
    assert bounded < 10 and unbounded > 28, (bounded, unbounded)  # 5 lanes of ~9 MB


def test_lanes_never_time_and_the_warm_up_measures_before_serving(tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(tmp_path))
    engine = Engine(fresh_tiny(), max_batch=2)
    first = engine.submit(Request(prompt=1, seed=0))  # window "auto"
    while engine.run_once():
        pass
    assert first.result().forward_passes > 0
    assert "timing" not in capsys.readouterr().err
    assert not (tmp_path / "cost_curves.json").exists()
    waiting = engine.submit(Request(prompt=2, seed=0))  # arrives while the server warms up
    engine.warm_up(Request(prompt=None))
    assert "timing one decoding iteration" in capsys.readouterr().err
    stored = json.loads((tmp_path / "cost_curves.json").read_text())
    assert sorted(json.loads(key)[-4] for key in stored) == [1, 2]  # batch sizes 1 and 2
    assert not engine.warming and engine.warm_end is not None
    while engine.run_once():
        pass
    assert waiting.result().warmup_s > 0 and first.result().warmup_s == 0


def test_health_says_warming_up_until_the_warm_up_ends(tiny):
    from fastapi.testclient import TestClient

    from speculaas.serve.app import create_app

    engine = Engine(tiny, max_batch=2)
    client = TestClient(create_app(engine))
    engine.warming = True
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "warming_up"
    engine.warming = False
    assert client.get("/health").json()["status"] == "ok"


def test_a_served_warm_up_says_warming_up_then_ok(tmp_path, monkeypatch):
    import httpx

    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(tmp_path))  # nothing measured yet
    with serve_process("--model", "tiny", "--max-batch", "2", "--warm-up", "60") as url:
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "ok"
    assert (tmp_path / "cost_curves.json").is_file()  # measured before it said ok


def test_every_call_gets_an_id_and_a_line_in_the_access_log(tiny, caplog):
    import logging

    from fastapi.testclient import TestClient

    from speculaas.serve.app import create_app

    engine = Engine(tiny, max_batch=2).start()
    try:
        client = TestClient(create_app(engine))
        with caplog.at_level(logging.INFO, logger="speculaas.serve.access"):
            bad = client.post("/v1/images/generations", json={"prompt": "3", "n": 0})
            ok = client.post("/v1/images/generations",
                             json={"prompt": "3", "window": 4, "method": "csd"})
    finally:
        engine.stop()
    assert bad.status_code == 400 and ok.status_code == 200
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"{bad.headers['x-request-id']} 400 ") and "'n'" in lines[0]
    assert lines[1].startswith(f"{ok.headers['x-request-id']} 200 n=1 method=csd ")


@pytest.fixture
def app_client(tiny):
    """A TestClient factory over a running engine on the tiny model (create_app's options)."""
    from fastapi.testclient import TestClient

    from speculaas.serve.app import create_app

    engine = Engine(tiny, max_batch=2, queue_size=3).start()
    yield lambda base_url="http://testserver", **opts: TestClient(
        create_app(engine, **opts), base_url=base_url)
    engine.stop()


GEN = "/v1/images/generations"


def test_json_only_as_json_and_within_the_body_limit(app_client):
    client = app_client()
    assert client.post(GEN, content=b'{"prompt": "3"}',
                       headers={"content-type": "text/plain"}).status_code == 415
    big = client.post(GEN, json={"prompt": "3", "user": "x" * 100_000})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    deep = client.post(GEN, content=b"[" * 20_000 + b"]" * 20_000,
                       headers={"content-type": "application/json"})
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]["message"]


def test_the_host_header_and_the_api_key_are_checked(app_client):
    from speculaas.serve.app import allowed_hosts

    hosts = allowed_hosts("127.0.0.1", 8000)
    rebound = app_client("http://attacker.example:8000", hosts=hosts)
    assert rebound.post(GEN, json={"prompt": "3", "n": 0}).status_code == 421
    local = app_client("http://localhost:8000", hosts=hosts)
    assert local.post(GEN, json={"prompt": "3", "n": 0}).status_code == 400  # past the check
    keyed = app_client(api_key="s3cret")
    refused = keyed.post(GEN, json={"prompt": "3", "n": 0})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert keyed.post(GEN, json={"prompt": "3", "n": 0},
                      headers={"authorization": "Bearer s3cret"}).status_code == 400
    assert allowed_hosts("0.0.0.0", 8000) is None


@pytest.mark.parametrize("args,message", [
    (["--port", "99999"], "--port must be from 1 to 65535"),
    (["--max-batch", "100000"], "--max-batch must be from 1 to 256")])
def test_serve_options_out_of_range_are_one_line_errors(args, message, capsys):
    from speculaas.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "tiny", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_a_lane_that_fails_to_build_fails_its_request_with_the_cause(tiny, monkeypatch, caplog):
    import speculaas.serve.engine as engine_mod

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory for the KV cache")

    engine = Engine(tiny, max_batch=2)
    monkeypatch.setattr(engine_mod, "Lane", broken)
    future = engine.submit(Request(prompt=1, seed=0, window=2))
    engine.run_once()
    with pytest.raises(RuntimeError, match="out of memory"):
        future.result(timeout=1)
    assert "building a lane" in caplog.text


def test_draining_answers_every_request_then_stops(tiny):
    from speculaas.serve.engine import ShuttingDown

    engine = Engine(tiny, max_batch=1)
    running, waiting = (Request(prompt=p, seed=s, window=2) for p, s in PROMPTS[:2])
    fr, fw = engine.submit(running), engine.submit(waiting)
    engine.run_once()  # `running` holds the one row; `waiting` waits
    engine.drain(timeout_s=60)
    with pytest.raises(ShuttingDown):
        engine.submit(Request(prompt=1))
    engine.start()
    engine.thread.join(timeout=30)
    assert not engine.thread.is_alive()  # stopped by itself once every request was answered
    assert fr.result(timeout=1).forward_passes > 0  # the running one finished
    with pytest.raises(Cancelled, match="shutting down"):
        fw.result(timeout=1)


def test_sigterm_mid_decode_answers_the_client_then_exits():
    import signal
    import threading
    import time

    import httpx
    from conftest import start_serve

    proc, url = start_serve()
    try:
        answer = {}

        def client() -> None:  # eight one-token-step images: seconds of decoding on a CPU
            body = {"prompt": "a big red circle on the left over grass", "n": 8, "window": 1}
            answer["r"] = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)

        thread = threading.Thread(target=client)
        thread.start()
        deadline, running = time.monotonic() + 120, 0  # a busy machine admits it late
        while time.monotonic() < deadline and not running:
            running = httpx.get(f"{url}/health").json()["running"]
            time.sleep(0.05)
        assert running, "the request was not admitted within 120 s"
        proc.send_signal(signal.SIGTERM)  # mid-decode: the client waits
        refused = None
        with contextlib.suppress(httpx.HTTPError):
            refused = httpx.post(f"{url}/v1/images/generations", json={
                "prompt": "a big red circle on the left over grass"}, timeout=10)
        thread.join(timeout=120)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert answer["r"].status_code == 200 and len(answer["r"].json()["data"]) == 8, out
    assert refused is None or refused.status_code == 503  # no new work once draining
    assert proc.returncode == 0 and "answered every one, exiting" in out


def test_sigterm_stops_the_server_cleanly():
    import signal

    from conftest import start_serve

    proc, _ = start_serve("--model", "tiny")
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "answered every one, exiting" in out


def test_half_sent_and_silent_connections_are_closed_after_the_header_timeout():
    """A client that sends part of a request head, or nothing, loses its socket after
    --header-timeout; a kept-alive connection that starts a second request and stalls too; a
    whole request is served as before."""
    import socket
    import time

    import httpx
    from conftest import start_serve

    proc, url = start_serve("--model", "tiny", "--header-timeout", "1")
    port = int(url.rsplit(":", 1)[1])

    def closed_within(sock, seconds) -> bool:
        sock.settimeout(seconds)
        try:
            while sock.recv(4096):  # a response to an earlier request may come first
                pass
            return True  # the server closed it
        except TimeoutError:
            return False
        finally:
            sock.close()

    try:
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        silent = socket.create_connection(("127.0.0.1", port))
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        time.sleep(0.5)
        kept.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, stalled
        t0 = time.monotonic()
        assert closed_within(half, 5) and closed_within(silent, 5) and closed_within(kept, 5)
        assert time.monotonic() - t0 < 5
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # still serving
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "sent no complete request head" in out


def test_a_list_of_prompts_returns_prompts_times_n_images_in_order(app_client, tiny):
    r = app_client().post(GEN, json={"prompt": ["1", "2"], "n": 2, "seed": 5, "window": 4})
    assert r.status_code == 200, r.text
    got = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in r.json()["data"]]
    want = [sp.generate(tiny, [p], method="sjd", seed=5 + i, window=4).images[0]
            for i, p in enumerate([1, 1, 2, 2])]
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    assert got[0].tobytes() != got[1].tobytes()  # seeds 5 and 6: two different images


def _events(text: str) -> list[dict]:
    import json

    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n")
            if block.startswith("event: ")]


def test_a_streamed_request_sends_previews_then_the_image_it_would_have_sent(app_client):
    client = app_client()
    body = {"prompt": "3", "seed": 2, "window": 2}
    plain = client.post(GEN, json=body).json()["data"][0]["b64_json"]
    with client.stream("POST", GEN, json={**body, "stream": True, "partial_images": 2}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e["partial_image_index"] for e in events[:2]] == [0, 1]
    assert events[-1]["b64_json"] == plain and events[-1]["speculaas"]["forward_passes"] > 0
    first = Image.open(io.BytesIO(base64.b64decode(events[0]["b64_json"]))).convert("RGB")
    final = Image.open(io.BytesIO(base64.b64decode(plain))).convert("RGB")
    assert first.size == final.size and first.tobytes() != final.tobytes()  # grey where open
    assert first.getpixel((first.width - 1, first.height - 1)) == (128, 128, 128)
    bad = client.post(GEN, json={**body, "partial_images": 1})
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]


def test_guided_images_count_two_rows_against_the_engine_budget():
    guided = sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0, cfg_scale=3.0)
    engine = Engine(guided, max_batch=4, max_rows=4)  # two guided images at once, over lanes
    reqs = [Request(prompt=p, seed=s, window=4, temperature=t)
            for (p, s), t in zip(PROMPTS[:4], (1.0, 1.0, 0.9, 0.9), strict=True)]
    futures = [engine.submit(r) for r in reqs]
    rows = []
    while engine.run_once():
        rows.append(engine.rows_in_flight())
    assert max(engine.batch_log) == 2 and max(rows) == 4
    for r, f in zip(reqs, futures, strict=True):
        solo = sp.generate(guided, [r.prompt], method="sjd", seed=r.seed, window=4,
                           temperature=r.temperature, decode_images=False)
        assert torch.equal(f.result().tokens, solo.tokens[0])
    with pytest.raises(ValueError, match="2 sample rows"):
        Engine(guided, max_rows=1).submit(Request(prompt=1))


def test_prometheus_metrics_count_what_the_engine_did(app_client, tiny):
    from prometheus_client.parser import text_string_to_metric_families

    client = app_client()
    ok = client.post(GEN, json={"prompt": ["1", "2"], "seed": 0, "window": 4})
    assert ok.status_code == 200
    assert client.post(GEN, json={"prompt": "3", "method": "fast"}).status_code == 400
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    stats = ok.json()["speculaas"]
    tokens = 2 * tiny.layout.length  # every position of both images (grid 3 x 5)
    assert samples[("speculaas_committed_tokens_total", ())] == tokens
    # each image stepped once per forward pass it spent
    assert samples[("speculaas_image_forwards_total", ())] == sum(
        s["forward_passes"] for s in stats)
    assert samples[("speculaas_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("speculaas_requests_total", (("outcome", "rejected"),))] == 1
    assert samples[("speculaas_queue_length", ())] == 0
    assert samples[("speculaas_step_compression_count", ())] == 2
    assert samples[("speculaas_iteration_seconds_count", ())] > 0
