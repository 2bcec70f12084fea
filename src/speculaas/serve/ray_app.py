"""`speculaas serve --ray`: the images API on Ray Serve, one continuous-batching engine per replica.

Each replica loads the model, measures its cost curves (warm-up, before Ray routes to it) and
runs one `Engine` on a thread of its own beside the replica's event loop, behind the same
FastAPI app as the single-process server (serve/app.py): the same endpoint, errors, /health
and /metrics, answered by the replica the request lands on (its id in /health and in the
x-speculaas-replica header). Ray Serve routes requests to the replicas with the shortest queues,
scales their number between bounds on the requests each has in flight, restarts a replica whose
engine died (check_health), and answers for the application as a whole at /-/healthz.
`@serve.batch` is not used: the engine batches by itself, in rows.

Also a `serve run` application: `serve run speculaas.serve.ray_app:app model=tiny replicas=2`
(every option of `RaySettings` as key=value).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from dataclasses import dataclass, field

from .app import MAX_BATCH, MAX_QUEUE, TIME_LIMIT_S

APP_NAME = "speculaas"
REPLICA_HEADER = "x-speculaas-replica"


@dataclass(frozen=True)
class RaySettings:
    """What every replica is built from, and how many run where. replicas: a fixed count, or,
    with max_replicas, the starting count of an autoscaled deployment (min_replicas ..
    max_replicas, scaled on `target_requests` requests in flight per replica; default: the
    engine's max_batch). cpus / gpus: Ray resources per replica (a GPU replica sees one device
    as cuda)."""

    model: str = "builtin"
    weights: str | None = None
    model_options: dict = field(default_factory=dict)
    max_batch: int = 8
    max_rows: int | None = None
    queue_size: int = 64
    time_limit_s: float = TIME_LIMIT_S
    warm_up_s: float = 120.0
    drafter: str | None = None
    api_key: str | None = None
    hosts: tuple[str, ...] | None = None  # Host headers answered (serve.app.allowed_hosts)
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_requests: float | None = None
    cpus: float = 1.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        if not (1 <= self.max_batch <= MAX_BATCH and 1 <= self.queue_size <= MAX_QUEUE):
            raise ValueError(f"max_batch must be from 1 to {MAX_BATCH} and queue_size from 1 "
                             f"to {MAX_QUEUE}, got {self.max_batch}, {self.queue_size}")
        if self.replicas < 1 or self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"--replicas must be >= 1 and --replica-cpus/--replica-gpus >= 0, "
                             f"got {self.replicas}, {self.cpus}, {self.gpus}")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if not 0 <= low <= self.replicas <= self.max_replicas:
                raise ValueError(f"replicas must satisfy 0 <= --min-replicas <= --replicas <= "
                                 f"--max-replicas, got {low}, {self.replicas}, "
                                 f"{self.max_replicas}")
        elif self.min_replicas is not None:
            raise ValueError("--min-replicas needs --max-replicas (autoscaling bounds)")
        if not self.time_limit_s > 0 or not self.warm_up_s >= 0:
            raise ValueError(f"time limit must be > 0 and warm-up >= 0 seconds, got "
                             f"{self.time_limit_s}, {self.warm_up_s}")

    def deployment_options(self) -> dict:
        """Ray Serve's options for the replica deployment."""
        options = {"ray_actor_options": {"num_cpus": self.cpus, "num_gpus": self.gpus},
                   # requests a replica takes before Serve holds them at the proxy: its batch
                   # and its queue
                   "max_ongoing_requests": self.max_batch + self.queue_size,
                   "health_check_period_s": 2, "health_check_timeout_s": 30,
                   "graceful_shutdown_timeout_s": 30}
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "initial_replicas": self.replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_requests or self.max_batch}
        return options


class EngineReplica:
    """One Ray Serve replica: a model, its engine on a thread, the images API over it."""

    def __init__(self, settings: RaySettings) -> None:
        from ray import serve

        from ..drafter.head import resolve_drafter
        from ..models import load_model
        from .engine import Engine, Request

        self.settings = settings
        model = load_model(settings.model, settings.weights, **settings.model_options)
        self.engine = Engine(model, max_batch=settings.max_batch, queue_size=settings.queue_size,
                             drafter=resolve_drafter(settings.drafter, model),
                             max_rows=settings.max_rows)
        if settings.warm_up_s > 0:  # before Serve routes anything here
            self.engine.warm_up(Request(prompt=None, method="sjd"), settings.warm_up_s)
        self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):  # noqa: ANN204 - Ray Serve's hook: the replica's app
        from .app import create_app

        s = self.settings
        return create_app(self.engine, s.time_limit_s,
                          None if s.hosts is None else set(s.hosts), s.api_key,
                          replica=self.replica_id)

    def check_health(self) -> None:
        """Ray Serve calls this every few seconds; a replica whose engine thread has stopped
        is replaced."""
        thread = self.engine.thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def build(settings: RaySettings):  # noqa: ANN201
    """The Ray Serve application (bound deployment) for `settings`."""
    from ray import serve

    replica = serve.ingress()(EngineReplica)
    return serve.deployment(name="EngineReplica", **settings.deployment_options())(
        replica).bind(settings)


def app(args: dict):  # noqa: ANN201
    """`serve run speculaas.serve.ray_app:app key=value ...`: RaySettings from text."""
    fields = {f.name: f for f in dataclasses.fields(RaySettings)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; valid: {', '.join(fields)}")
    parsed = {}
    for key, value in args.items():
        kind = str(fields[key].type)
        if isinstance(value, str) and value.lower() in ("none", "null"):
            value = None
        elif isinstance(value, str) and ("dict" in kind or "tuple" in kind):
            import json

            value = json.loads(value)
            value = tuple(value) if "tuple" in kind else value
        elif isinstance(value, str) and "int" in kind:
            value = int(value)
        elif isinstance(value, str) and "float" in kind:
            value = float(value)
        parsed[key] = value
    return build(RaySettings(**parsed))


def serve_ray(settings: RaySettings, host: str = "127.0.0.1", port: int = 8000,
              address: str | None = None, wait_s: float | None = None) -> None:
    """Run the application on the Ray cluster at `address` (None: start a local one) with
    Serve's HTTP proxy on host:port, until Ctrl-C or SIGTERM (or `wait_s` seconds); then delete
    the application and leave the cluster. A local cluster binds Ray's own services to loopback
    when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before ray is imported (the CLI sets it for
    a loopback server)."""
    import sys

    import ray
    from ray import serve

    if not 0 < port < 65536:
        raise ValueError(f"--port must be from 1 to 65535, got {port}")
    if address is None:
        ray.init(include_dashboard=False)
    else:
        try:
            ray.init(address=address)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ValueError(f"cannot join the Ray cluster at {address!r}: {e}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(settings), name=APP_NAME, route_prefix="/")
        count = (f"{settings.replicas} replicas" if settings.max_replicas is None else
                 f"{settings.replicas} replicas (autoscaled up to {settings.max_replicas})")
        print(f"speculaas serve --ray: {settings.model} on http://{host}:{port}/v1, {count}; "
              "POST /v1/images/generations, GET /health (a replica), /metrics (a replica), "
              "/-/healthz (the application)", flush=True)
        stop.wait(wait_s)
    finally:
        print("speculaas serve --ray: stopping the application", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.shutdown()


__all__ = ["APP_NAME", "REPLICA_HEADER", "EngineReplica", "RaySettings", "app", "build",
           "serve_ray"]
