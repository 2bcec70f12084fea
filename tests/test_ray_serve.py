"""`speculaas serve --ray`: the images API on Ray Serve replicas, on a local Ray cluster started
by the test on 127.0.0.1. Two replicas share concurrent requests, each image is the one a solo
generate() draws for its seed; a replica killed mid-request answers its requests with an error
(none hangs), is replaced, and the application keeps serving."""

import base64
import io
import threading
import time

import pytest
from conftest import free_port
from PIL import Image

import speculaas as sp

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from speculaas.serve.ray_app import APP_NAME, REPLICA_HEADER, RaySettings, build  # noqa: E402

# Big enough that a one-token-step image takes a while (a replica can be killed mid-decode).
TINY = {"vocab_size": 64, "grid": (32, 32), "seed": 0}


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2,
             log_to_driver=False)  # on loopback only (conftest: Ray's single-machine mode)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = RaySettings(model="tiny", model_options=TINY, max_batch=2, queue_size=8,
                               warm_up_s=0, replicas=2, cpus=0.5)
        serve.run(build(settings), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _image(response) -> Image.Image:  # noqa: ANN001
    return Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))


def _post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=timeout)


def test_two_replicas_serve_concurrent_requests_each_its_seeds_image(cluster):
    results = {}

    def client(seed: int) -> None:
        results[seed] = _post(cluster, {"prompt": "3", "seed": seed, "window": 4})

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == list(range(8))
    assert all(r.status_code == 200 for r in results.values()), results
    assert len({r.headers[REPLICA_HEADER] for r in results.values()}) == 2  # both were used
    model = sp.load_model("tiny", **TINY)
    for seed, r in results.items():
        solo = sp.generate(model, [3], method="sjd", seed=seed, window=4)
        assert _image(r).tobytes() == solo.images[0].tobytes(), seed
    health = httpx.get(f"{cluster}/health").json()
    assert health["status"] == "ok" and health["replica"] in {
        r.headers[REPLICA_HEADER] for r in results.values()}
    assert httpx.get(f"{cluster}/-/healthz").status_code == 200  # the application's
    listed = _post(cluster, {"prompt": ["1", "2"], "n": 2, "window": 4})
    assert listed.status_code == 200 and len(listed.json()["data"]) == 4


def _replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and a["namespace"] == "serve"]


def test_a_killed_replica_fails_its_requests_is_replaced_and_the_app_keeps_serving(cluster):
    results, threads = {}, []

    def client(seed: int) -> None:
        try:  # one-token steps over 1024 positions: long enough to be killed mid-decode
            results[seed] = _post(cluster, {"prompt": "3", "seed": seed, "window": 1}, 90)
        except httpx.HTTPError as e:
            results[seed] = e

    for seed in range(4):
        threads.append(threading.Thread(target=client, args=(seed,)))
        threads[-1].start()
    assert len(_replicas()) == 2
    deadline, busy = time.monotonic() + 30, None
    while busy is None and time.monotonic() < deadline:  # a replica that is decoding
        health = httpx.get(f"{cluster}/health").json()
        busy = health["replica"] if health["running"] else None
        time.sleep(0.02)
    victims = [name for name in _replicas() if name.endswith(f"#{busy}")]
    assert len(victims) == 1, (busy, _replicas())
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)  # nobody hangs
    assert sorted(results) == [0, 1, 2, 3]
    failed = [r for r in results.values() if not (isinstance(r, httpx.Response)
                                                  and r.status_code == 200)]
    assert failed  # the victim was decoding: its requests cannot have finished
    for r in failed:  # a clear error: an HTTP error status, or the connection closed
        assert isinstance(r, httpx.HTTPError) or r.status_code >= 500, r
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        alive = _replicas()
        if len(alive) == 2 and victims[0] not in alive:
            break
        time.sleep(0.5)
    assert len(_replicas()) == 2 and victims[0] not in _replicas()  # replaced
    after = _post(cluster, {"prompt": "3", "seed": 7, "window": 4})
    assert after.status_code == 200


def test_the_serve_run_builder_and_the_settings_are_checked():
    from speculaas.serve.ray_app import app

    bound = app({"model": "tiny", "model_options": '{"vocab_size": 8, "grid": [2, 3]}',
                 "replicas": "2", "max_replicas": "4", "cpus": "0.5", "drafter": "none"})
    assert type(bound).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown option"):
        app({"modle": "tiny"})
    with pytest.raises(ValueError, match="max-replicas"):
        RaySettings(replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="needs --max-replicas"):
        RaySettings(min_replicas=1)
    options = RaySettings(replicas=2, max_replicas=4, cpus=2, gpus=1).deployment_options()
    assert options["autoscaling_config"]["max_replicas"] == 4
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}


def test_the_cli_serves_on_ray_and_stops_on_sigterm():
    import signal

    from conftest import start_serve

    proc, url = start_serve("--ray", "--model", "tiny", "--model-opt", "grid=3,5",
                            "--replica-cpus", "0.5", wait_s=180)
    try:
        r = _post(url, {"prompt": "2", "seed": 1, "window": 4})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopping the application" in out, out
