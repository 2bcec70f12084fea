import contextlib
import os
import tempfile

import pytest
import torch

# Measured cost curves (window="auto") persist in one place per test session, shared with the
# subprocesses tests start, never in the user's cache.
os.environ.setdefault("SPECULAAS_CACHE_DIR", tempfile.mkdtemp(prefix="speculaas-cache-"))

torch.set_num_threads(min(2, torch.get_num_threads()))  # OMP_NUM_THREADS=1 lowers it

# Local Ray clusters started by tests (and the servers they start) bind every service to
# loopback: Ray's single-machine mode, read when ray is first imported (serve/ray_app.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# Options under which a relaxed rule must be exactly SJD.
ZERO_RELAXATION = [("csd", {"lam": 0.0}), ("csd", {"delta": 0.0}), ("addition", {"eps": 0.0}),
                   ("amplify", {"k": 1.0})]


@pytest.fixture(scope="session")
def tiny():
    import speculaas as sp
    return sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)


@pytest.fixture(scope="session")
def builtin():
    import speculaas as sp
    return sp.load_model("builtin")


def check_rollback(model, prompt, sequence, vocab, cfg=True, split=5, atol=1e-4):
    """Feed junk windows between two real ones: after the cache rolls back by position, the
    logits equal a fresh forward pass over the committed prefix (to `atol`)."""
    g = torch.Generator().manual_seed(0)
    prev = torch.cat([torch.zeros(1, 1, dtype=torch.long), sequence[None, :-1]], 1)
    one, at = torch.tensor([0]), lambda n: torch.tensor([n])
    session = model.start([prompt], cfg=cfg)
    session.forward(torch.randint(vocab, (1, 7), generator=g), at(0), one)
    c1, u1 = session.forward(prev[:, : split + 1], at(0), one)
    session.forward(torch.randint(vocab, (1, 6), generator=g), at(split), one)
    c2, u2 = session.forward(prev[:, split:], at(split), one)
    c, u = model.start([prompt], cfg=cfg).forward(prev, at(0), one)
    assert torch.allclose(torch.cat([c1[:, :split], c2], 1), c, atol=atol)
    if cfg:
        assert torch.allclose(torch.cat([u1[:, :split], u2], 1), u, atol=atol)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, wait_s: float = 60.0):  # noqa: ANN201
    """`speculaas serve ARGS` on a free loopback port, once /health says ok: (the process, its
    base URL); the server's output in the error if it never does. Without a --warm-up in ARGS
    the server skips its warm-up (tests of the warm-up ask for it)."""
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    if "--warm-up" not in args:
        args = (*args, "--warm-up", "0")
    proc = subprocess.Popen([sys.executable, "-m", "speculaas.cli", "serve", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"speculaas serve did not start: {proc.stdout.read()}")
        time.sleep(0.1)


@contextlib.contextmanager
def serve_process(*args: str, wait_s: float = 60.0):
    """start_serve as a context: yields the base URL; the server is terminated on exit."""
    proc, url = start_serve(*args, wait_s=wait_s)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def demo_url():
    """The demo app on the built-in model, served by uvicorn on a free loopback port."""
    import threading
    import time

    import uvicorn

    import speculaas as sp
    from speculaas.demo.app import create_app

    port = free_port()
    app = create_app(sp.load_model("builtin"))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)
    app.state.engine.stop()


def assert_same_as_ar(model, prompts, windows=(1, 2, 16, 64, "auto"), seed=0, method="sjd",
                      **options):
    """Sample-exact decoding: `method` (an exact rule) draws token for token what AR draws for
    the same seeds, at every window, and each image alone draws what it draws in the batch."""
    import speculaas as sp

    sampling = {k: v for k, v in options.items()
                if k in ("temperature", "top_k", "top_p", "cfg_scale")}
    ar = sp.generate(model, prompts, method="ar", seed=seed, decode_images=False, **sampling)
    other = sp.generate(model, prompts, method="ar", seed=seed + 1000, decode_images=False,
                        **sampling)
    assert not torch.equal(other.sequence, ar.sequence)  # the seed matters: the check has power
    for window in windows:
        out = sp.generate(model, prompts, method=method, window=window, seed=seed,
                          decode_images=False, **options)
        assert torch.equal(out.sequence, ar.sequence), (window, out.sequence != ar.sequence)
    alone = sp.generate(model, prompts[-1:], method=method, window=windows[-1],
                        seed=[seed + len(prompts) - 1], decode_images=False, **options)
    assert torch.equal(alone.sequence[0], ar.sequence[-1])
    return ar
