"""`generate()`: the one-call entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from PIL import Image

from . import acceptance
from .checks import is_integer
from .config import DEFAULT_COUPLING, DEFAULT_DRAFT_INIT, METHODS, JacobiConfig, SamplingConfig
from .decoding import DecodeResult, autoregressive_decode, decode
from .decoding.drafting import blend_for
from .decoding.frontier_rows import check_row_context
from .decoding.tree import check_tree
from .decoding.window import WindowPolicy
from .drafter.head import resolve_drafter
from .models.base import ImageModel


@dataclass
class GenerationOutput:
    """Result of `generate()`. B images on a rows x cols grid of N = rows * cols tokens.

    tokens [B, N] image tokens in raster order; images: PIL images; forward_passes [B] target
    forwards spent on each image (prefill excluded: AR spends N); commit_step [B, rows, cols]
    iteration that committed each token; drafted [B, rows, cols] True where an accepted draft was
    committed; entropy [B, rows, cols] target entropy (nats) at each token's verification;
    latency_s wall time of prefill + decode (image decoding excluded). windows: per image,
    forwards at each window size {W: count} (AR: all at 1); mean_window the mean of it.
    """

    method: str
    tokens: torch.Tensor
    images: list[Image.Image]
    forward_passes: torch.Tensor
    commit_step: torch.Tensor
    drafted: torch.Tensor
    entropy: torch.Tensor
    accept_hist: torch.Tensor
    latency_s: float
    rule_seconds: float
    options: dict = field(default_factory=dict)
    sequence: torch.Tensor | None = None  # generated tokens including structural ones
    mean_window: torch.Tensor | None = None  # [B] mean window per image (1 for AR)
    windows: list[dict[int, int]] = field(default_factory=list)  # per image {window: forwards}
    head_seconds: float = 0.0  # inside a draft head's chains (with profile=True)

    @property
    def step_compression(self) -> torch.Tensor:
        """Tokens per target forward, per image: N / forward_passes."""
        return self.tokens.shape[1] / self.forward_passes.float()


def resolve_sampling(model: ImageModel, temperature: float | None = None,
                     top_k: int | None = None, top_p: float | None = None,
                     cfg_scale: float | None = None) -> SamplingConfig:
    """None takes the model's default; top_k=0, top_p=1 and cfg_scale=1 switch each off."""
    d = model.defaults
    top_k = d.top_k if top_k is None else (None if top_k == 0 else top_k)
    return SamplingConfig(temperature=d.temperature if temperature is None else temperature,
                          top_k=top_k, top_p=d.top_p if top_p is None else top_p,
                          cfg_scale=d.cfg_scale if cfg_scale is None else cfg_scale)


def build_rule(model: ImageModel, method: str, **options) -> acceptance.AcceptanceRule | None:
    """The acceptance rule of `method` with the model data it needs; None for "ar"."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {METHODS}")
    if method == "ar":
        if options:
            raise ValueError(f"method 'ar' takes no options, got {sorted(options)}")
        return None
    cls = acceptance.RULES[method]
    data = {}
    for need in cls.needs:
        value = getattr(model, need)()
        if value is not None:
            data[need] = value
    return acceptance.get(method, **options, **data)


def generators_for(model: ImageModel, seed: int | list[int], batch: int) -> list[torch.Generator]:
    """Per-image random streams: image i of a call with seed s uses seed s + i (or seed[i]
    when a list is given), so an image does not depend on what else is in its batch."""
    if isinstance(seed, (list, tuple)):
        seeds = list(seed)
    elif is_integer(seed):
        seeds = [int(seed) + i for i in range(batch)]
    else:
        raise ValueError(f"seed must be an integer or a list of integers, got {seed!r}")
    if not all(is_integer(s) and 0 <= s < 2**63 - batch for s in seeds):
        raise ValueError(f"seeds must be integers in [0, 2**63), got {seed!r}")
    if len(seeds) != batch:
        raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
    return [torch.Generator(device=model.device).manual_seed(int(s)) for s in seeds]


def generate(model: ImageModel, prompts, method: str = "csd", seed: int | list[int] = 0,
             window: int | str | WindowPolicy | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None,
             cfg_scale: float | None = None,
             draft_init: str = DEFAULT_DRAFT_INIT, coupling: str = DEFAULT_COUPLING,
             advance: str = "per_image", row_context: int | None = None,
             verify: str = "gumbel", tree: tuple | str | None = None,
             drafter=None, draft_depth: int | None = None,  # noqa: ANN001
             head_blend: float | None = None,
             progress=False, max_batch: int = 32,
             decode_images: bool = True, profile: bool = False, **options) -> GenerationOutput:
    """Generate one image per prompt with `method` (see METHODS); method options by name
    (csd: lam, delta, filter; gsd: group_size, prob_threshold, dist_threshold; lantern: k,
    delta; amplify: k; addition: eps). Batches larger than `max_batch` run in chunks of that
    size, one after the other (same images: each image has its own random stream).
    window: slots per forward (int), "auto" or a WindowPolicy; None (default): "auto" in raster
    order (chosen every iteration from a cost curve: for sample-exact rules this machine's,
    learned while decoding; for the others the device kind's reference, so that a seed draws
    the same picture however busy the machine is; plain AR where no window pays), 16 with
    row_context.
    verify: "gumbel" (default): exact rules commit the AR sample of every position (the same
    tokens as method "ar" for the same seed, at any window or batch); "ratio": the classic
    min(1, target/draft) test (JacobiConfig).
    row_context=c: the two-dimensional window (several rows in flight; not lossless), for
    models whose adapters take a row-causal mask (builtin, tiny, llamagen).
    tree=(K, D) or (K, D, N): K candidate tokens at each of up to D positions at the head of
    every window, N off-chain nodes, verified in the same forward under a tree attention mask
    (decoding/tree.py); `window` is then the width budget per image and forward, the tree's
    slots included ("auto": a tree width only where the cost curve says the tree pays, else the
    chain). Same models as row_context; every rule keeps its law.
    drafter: a trained draft head for this model (a folder written by `speculaas
    train-drafter`, "shipped" for the built-in model's, or a loaded DraftHead) drafting
    `draft_depth` slots at the head of every window from the target's own features, its law
    multiplied by the slot's stale law (the draft waiting there) to the power `head_blend`
    (0: the head alone; None: 0.5, or 0 for a head that reads the stale feature itself);
    every rule keeps its law (sjd still draws ar's tokens), and a head trained for other
    weights is refused."""
    if not isinstance(model, ImageModel):
        hint = f"sp.load_model({model!r})" if isinstance(model, str) else "sp.load_model(NAME)"
        raise ValueError(f"model must be a loaded model ({hint}), got "
                         f"{type(model).__name__} {model!r}"[:200])
    if not isinstance(prompts, (list, tuple)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass one prompt (or None) per image")
    if not (is_integer(max_batch) and max_batch >= 1):
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    model.check_prompts(list(prompts))
    rule = build_rule(model, method, **options)
    sampling = resolve_sampling(model, temperature, top_k, top_p, cfg_scale)
    policy = window if isinstance(window, WindowPolicy) else None
    jacobi = JacobiConfig(window=policy.max_window if policy else window, draft_init=draft_init,
                          coupling=coupling, advance=advance, row_context=row_context,
                          verify=verify, tree=tree, draft_depth=draft_depth,
                          head_blend=head_blend)
    head = resolve_drafter(drafter, model) if rule is not None else None
    check_row_context(model, jacobi, speculative=rule is not None, policy=policy)
    if jacobi.tree is not None and rule is not None:
        check_tree(jacobi.tree, model, jacobi.window)
    gens = generators_for(model, seed, len(prompts))
    bar = None
    if hasattr(progress, "update"):  # the caller's own progress object (update(n), close())
        bar = progress
    elif progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts) * model.layout.length, desc=method, unit="tok",
                   dynamic_ncols=True, leave=False)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    parts = []
    for lo in range(0, len(prompts), max_batch):  # chunks: memory stays bounded
        hi = min(lo + max_batch, len(prompts))
        session = model.start(list(prompts[lo:hi]), cfg=sampling.uses_cfg)
        if rule is None:
            parts.append(autoregressive_decode(model, session, sampling, gens[lo:hi], bar))
        else:
            parts.append(decode(model, session, rule, sampling, jacobi, gens[lo:hi], bar,
                                profile=profile, policy=policy, drafter=head))
    res = DecodeResult.concat(parts)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    latency = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    lay = model.layout
    rows, cols = lay.grid

    def grid(x: torch.Tensor) -> torch.Tensor:
        return lay.image_tokens(x).reshape(len(prompts), rows, cols).cpu()

    return GenerationOutput(
        method=method, tokens=lay.image_tokens(res.tokens).cpu(),
        images=model.decode(res.tokens) if decode_images else [],
        forward_passes=res.forward_passes.cpu(), commit_step=grid(res.commit_step),
        drafted=grid(res.drafted), entropy=grid(res.entropy), accept_hist=res.accept_hist.cpu(),
        latency_s=latency, rule_seconds=res.rule_seconds, head_seconds=res.head_seconds,
        options={"window": jacobi.window, "draft_init": draft_init, "coupling": coupling,
                 "verify": verify,
                 **({"row_context": row_context} if row_context is not None else {}),
                 **({"tree": jacobi.tree} if jacobi.tree is not None else {}),
                 **({"drafter": head.head_id, "draft_depth": jacobi.draft_depth
                     or head.cfg.depth, "head_blend": blend_for(head, jacobi.head_blend)}
                    if head is not None else {}),
                 **options, **vars(sampling)},
        sequence=res.tokens.cpu(),
        mean_window=res.mean_window.cpu(),
        windows=[{w: n for w, n in enumerate(row) if n}
                 for row in res.window_hist.cpu().tolist()])
