"""How deep must a drafter be? Agreement of a truncated copy of the target, offline.

    python benchmarks/drafter_depth.py [--data DIR] [--images 432] [--held 48] [--steps 800]

A truncated copy of the target (its first k layers, sharing their key-value cache, then an
exit to the output head: LayerSkip's and Draft&Verify's self-drafter) sees the true prefix at
every step of a chain as long as its drafts are accepted, so its first-step agreement is its
agreement at every step. For each depth k of the built-in model this prints held-out agreement
of the drafter's Gumbel sample with the target's (what decides acceptance under sample-exact
verification) and the total variation to the target's law, for two exits:
- lens: the target's own final norm and output head on layer k's state (no training);
- trained: a residual MLP exit (k's state -> the final feature) trained with train-drafter's
  loss (distill_loss) on the collected samples, the same minibatches for every k.
k = n_layers is the target itself (agreement 1): the check that states and samples line up.
Also printed: the drafter's cost per drafted token in target forwards (k / n_layers) and the
step compression a chain of d drafts then reaches at that agreement (a geometric run, every
step agreeing independently), with the forwards a drafted token costs counted in.
The samples are train-drafter's own collection (kept in --data and reused; other settings,
e.g. another --temperature or --images, collect afresh there: give each its own folder).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

import speculaas as sp
from speculaas.config import TrainConfig
from speculaas.drafter.train import (
    collect,
    default_prompts,
    distill_loss,
    target_law,
    teacher_features,
)


class Exit(nn.Module):
    """Layer k's residual state -> a feature in the output head's input space."""

    def __init__(self, dim: int, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                 nn.Linear(2 * dim, dim))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)  # starts as the lens
        self.norm = norm  # the target's final norm, frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(x))


@torch.no_grad()
def layer_states(model, prompts: list, tokens: np.ndarray, rows: int) -> torch.Tensor:  # noqa: ANN001
    """Every block's output at every image slot of teacher-forced samples: [b, L, T, R, D]
    float16 (layer-major), rows cond, uncond."""
    blocks = model.decoder.blocks
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: seen.append(out)) for b in blocks]
    try:
        seq = torch.from_numpy(tokens.astype(np.int64))
        teacher_features(model, prompts, seq, rows == 2)
    finally:
        for h in hooks:
            h.remove()
    b, length = seq.shape
    out = torch.stack(seen[-len(blocks):])  # the image forward's (the prompt's came first)
    if out.shape[1:3] != (rows * b, length):
        raise RuntimeError(f"block outputs {tuple(out.shape)} are not [L, {rows * b}, {length}, D]")
    out = out.view(len(blocks), rows, b, length, -1).permute(2, 0, 3, 1, 4)
    return out.half().clone(memory_format=torch.contiguous_format)


def rows_first(t: torch.Tensor) -> torch.Tensor:
    """[b, P, R, D] -> [b * R, P, D], rows cond, uncond per image (distill_loss's layout)."""
    return t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])


def guided(io, feats: torch.Tensor, rows: int, sampling, structural) -> torch.Tensor:  # noqa: ANN001
    """features [b, T, R, D] -> the target's sampled law [b, T, V] (train.target_law)."""
    return target_law(io, rows_first(feats), rows, sampling, structural)[1]


def compression(a: float, depth: int, cost: float) -> tuple[float, float]:
    """Tokens per verify forward of a chain of `depth` drafts agreeing with probability a each
    (a geometric run, plus the verify forward's own token), and per target forward with the
    drafts' cost (depth x cost) counted in."""
    tokens = sum(a ** i for i in range(depth + 1))
    return tokens, tokens / (1 + depth * cost)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="drafter-depth-data")
    p.add_argument("--images", type=int, default=432)
    p.add_argument("--held", type=int, default=48, help="held-out images (the last ones)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=16, help="images per step")
    p.add_argument("--positions", type=int, default=64, help="loss positions per image")
    p.add_argument("--chain", type=int, default=4, help="drafts per chain in the model column")
    p.add_argument("--temperature", type=float, default=None,
                   help="sample and measure at this temperature (default: the model's)")
    p.add_argument("--layers", default="", help="depths to measure, e.g. 4,5 (default: all)")
    args = p.parse_args()
    if not 0 < args.held < args.images:
        raise SystemExit("--held must be in 1..--images - 1")
    if args.temperature is not None and not args.temperature > 0:
        raise SystemExit("--temperature must be above 0")
    model = sp.load_model("builtin")
    sampling, io, structural = model.defaults, model.draft_io(), model.layout.structural
    if args.temperature is not None:
        sampling = replace(sampling, temperature=args.temperature)
    n_layers = len(model.decoder.blocks)
    try:
        depths = [int(k) for k in args.layers.split(",")] if args.layers else []
    except ValueError:
        raise SystemExit(f"--layers must be integers, e.g. 4,5; got {args.layers!r}") from None
    if any(not 1 <= k <= n_layers for k in depths):
        raise SystemExit(f"--layers must lie in 1..{n_layers}")
    prompts = default_prompts(model, args.images, 0)
    t0 = time.perf_counter()
    data = collect(model, prompts, sampling, Path(args.data), TrainConfig(images=args.images))
    rows = data.meta["rows"]
    print(f"data: {data.done} images ({time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    states = torch.cat([layer_states(model, prompts[lo: lo + 16], data.tokens[lo: lo + 16], rows)
                        for lo in range(0, args.images, 16)])  # [n, L, T, R, D]
    true = torch.from_numpy(data.features[: args.images].astype(np.float32))  # [n, T, R, D]
    print(f"layer states: {tuple(states.shape)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    held = np.arange(args.images - args.held, args.images)
    pool = args.images - args.held
    length = states.shape[2]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        q_held = torch.cat([guided(io, true[i: i + 8], rows, sampling, structural)
                            for i in range(held[0], args.images, 8)])
        noise = torch.empty(q_held.shape).exponential_(generator=gen)
        sample = (q_held / noise).argmax(-1)

    def score(law: torch.Tensor) -> dict:
        hit = ((law / noise).argmax(-1) == sample).float().mean().item()
        tv = (0.5 * (law - q_held).abs().sum(-1)).mean().item()
        return {"agreement": round(hit, 3), "tv": round(tv, 3)}

    results = []
    for k in depths or range(1, n_layers + 1):
        with torch.no_grad():
            lens = torch.cat([guided(io, model.decoder.norm(states[i: i + 8, k - 1].float()),
                                     rows, sampling, structural)
                              for i in range(held[0], args.images, 8)])
        res = {"layers": k, "cost": round(k / n_layers, 3), "lens": score(lens)}
        if k < n_layers:
            torch.manual_seed(0)
            ex = Exit(io.dim, model.decoder.norm)
            params = list(ex.mlp.parameters())
            opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01)
            t0 = time.perf_counter()
            for step in range(args.steps):
                rng = np.random.default_rng([0, step])
                imgs = rng.integers(0, pool, args.batch)
                pos = torch.from_numpy(np.sort(rng.choice(length, args.positions, False)))
                x = states[imgs, k - 1][:, pos].float()  # [b, P, R, D]
                tgt = true[imgs][:, pos]
                for g in opt.param_groups:
                    g["lr"] = 2e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
                loss = distill_loss(io, ex(rows_first(x)), rows_first(tgt), rows, sampling,
                                    structural)[0].mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            with torch.no_grad():
                trained = torch.cat([guided(io, ex(states[i: i + 8, k - 1].float()), rows,
                                            sampling, structural)
                                     for i in range(held[0], args.images, 8)])
            res["trained"] = score(trained)
            res["train_seconds"] = round(time.perf_counter() - t0)
        best = max(res["lens"]["agreement"], res.get("trained", {}).get("agreement", 0))
        res["chain_tokens"], res["tokens_per_forward"] = (
            round(x, 2) for x in compression(best, args.chain, k / n_layers))
        results.append(res)
        print(json.dumps(res), flush=True)
    print(f"\n| layers (of {n_layers}) | cost per draft | lens: agreement | TV | trained exit: "
          f"agreement | TV | tokens per verify ({args.chain} drafts) | per target forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        t = r.get("trained", {"agreement": "-", "tv": "-"})
        print(f"| {r['layers']} | {r['cost']} | {r['lens']['agreement']} | {r['lens']['tv']} | "
              f"{t['agreement']} | {t['tv']} | {r['chain_tokens']} | {r['tokens_per_forward']} |")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
