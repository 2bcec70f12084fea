"""Does a draft head gain from attention over the prefix? One head step, offline, two heads.

    python benchmarks/drafter_context.py [--data DIR] [--images 1536] [--steps 1500]
        [--heads mlp,attention] [--train-images N]

Both heads do the first chain step of `speculaas train-drafter` (from the target's feature that
decided position t and the token drawn there, the feature that decides t + 1), trained on the
same collected samples (the command's own collection, kept in --data and reused), the same
minibatches and the same losses:
- mlp: the shipped architecture (DraftHead: the last feature, two tokens, the position);
- attention: the same input, then one causal self-attention block over every earlier position's
  input (EAGLE's decoder layer over the target's features), then the same MLP blocks.
Reported: held-out agreement of the head's Gumbel sample with the target's (what decides
acceptance under sample-exact verification) and total variation, for the head's law alone and
for its product with the stale law^0.5 (the loop's default blend; the stale law is the target's
law at t + 1 with a rejected token, drawn from the law of t, at t). The last line is a JSON of
every number. --train-images N trains on fewer of the samples: how agreement grows with data.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import speculaas as sp
from speculaas.config import TrainConfig
from speculaas.drafter.head import DraftHead, HeadConfig
from speculaas.drafter.train import (
    collect,
    default_prompts,
    distill_loss,
    draw_other,
    target_law,
    teacher_features,
)

GAP = 17  # stale passes: one rejected draft in GAP positions


class AttentionHead(nn.Module):
    """DraftHead's input and blocks with one causal self-attention block in front."""

    def __init__(self, cfg: HeadConfig, heads: int = 4) -> None:
        super().__init__()
        self.mlp = DraftHead(cfg)
        w = cfg.width
        self.norm = nn.LayerNorm(w)
        self.attn = nn.MultiheadAttention(w, heads, batch_first=True)

    def forward(self, feature, left, above, has_above, pos, picks):  # noqa: ANN001, ANN201
        """Inputs [b, T, ...] -> the features at positions `picks` [P], [b, P, dim]: every
        position is a key, only the picked ones are queries (causal)."""
        m = self.mlp
        above = torch.where(has_above[..., None], above, m.no_above)
        x = m.inp(torch.cat([feature, left, above], -1)) + m.pos(pos)
        n = x.shape[1]
        mask = torch.arange(n, device=x.device)[None] > picks[:, None]  # [P, T]
        y = self.norm(x)
        x = x[:, picks] + self.attn(y[:, picks], y, y, attn_mask=mask, need_weights=False)[0]
        for block in m.blocks:
            x = x + block(x)
        return m.out(x)


class PlainHead(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.mlp = DraftHead(cfg)

    def forward(self, feature, left, above, has_above, pos, picks):  # noqa: ANN001, ANN201
        return self.mlp(feature[:, picks], left[:, picks], above[:, picks],
                        has_above[:, picks], pos[:, picks])


def sequences(data, images: np.ndarray, stride: int, io, dev):  # noqa: ANN001, ANN201
    """Whole-image head inputs: features [b*R, T, D] (rows cond, uncond per image), embeddings
    of the token at t and of the one above t + 1 (t + 1 - stride), which exist, positions."""
    tokens = torch.from_numpy(data.tokens[images].astype(np.int64)).to(dev)
    feats = torch.from_numpy(data.features[images].astype(np.float32)).to(dev)  # [b, T, R, D]
    b, length, r, d = feats.shape
    feats = feats.permute(0, 2, 1, 3).reshape(b * r, length, d)
    t = torch.arange(length, device=dev)
    above_pos = t + 1 - stride
    has_above = (above_pos >= 0)[None].expand(b * r, -1)
    emb = io.embed(tokens).float().repeat_interleave(r, 0)
    above = emb[:, above_pos.clamp(min=0)]
    return feats, emb, above, has_above, (t + 1).clamp(max=length)[None].expand(b * r, -1)


def step_loss(head, batch, io, r, sampling, structural, picks):  # noqa: ANN001, ANN201
    """train-drafter's own loss (distill_loss) at positions `picks`, averaged."""
    feats, emb, above, has_above, pos = batch
    out = head(feats, emb, above, has_above, pos, picks)  # [bR, P, D]: decides t + 1
    return distill_loss(io, out, feats[:, picks + 1], r, sampling, structural)[0].mean()


@torch.no_grad()
def measure(head, data, images, stride, io, r, sampling, structural, stale_q, dev):  # noqa: ANN001, ANN201
    """Agreement and TV, head alone and head x stale^0.5 (and the stale law), over all positions
    of `images`; after_rejection: agreement weighted by how likely a rejection just before is."""
    gen = torch.Generator(device=dev).manual_seed(1)
    sums = {"alone": [0.0, 0.0, 0.0], "blend": [0.0, 0.0, 0.0], "stale": [0.0, 0.0, 0.0]}
    count = weights = 0
    for lo in range(0, len(images), 4):
        chunk = images[lo: lo + 4]
        batch = sequences(data, chunk, stride, io, dev)
        feats = batch[0]
        length = feats.shape[1]
        picks = torch.arange(length - 1, device=dev)
        out = head(*batch, picks)
        _, q = target_law(io, feats[:, picks + 1], r, sampling, structural)
        _, p = target_law(io, out, r, sampling, structural)
        sq = stale_q[lo: lo + 4][:, : length - 1].to(dev)
        blend = p * sq.pow(0.5)
        blend = blend / blend.sum(-1, keepdim=True)
        noise = torch.empty(q.shape, device=dev).exponential_(generator=gen)
        sample = (q / noise).argmax(-1)
        # A rejection at t is as likely as the stale draft's law there is far from the
        # target's: weigh position t + 1 by that distance at t (rejections gather where the
        # law is flat, and so does the next position's).
        tv_stale = 0.5 * (sq - q).abs().sum(-1)
        weight = torch.cat([torch.zeros_like(tv_stale[:, :1]), tv_stale[:, :-1]], 1)
        for name, law in (("alone", p), ("blend", blend), ("stale", sq)):
            hit = ((law / noise).argmax(-1) == sample).float()
            sums[name][0] += hit.sum().item()
            sums[name][1] += (0.5 * (law - q).abs().sum(-1)).sum().item()
            sums[name][2] += (hit * weight).sum().item()
        count += q.shape[0] * q.shape[1]
        weights += weight.sum().item()
    return {k: {"agreement": round(a / count, 3), "tv": round(t / count, 3),
                "after_rejection": round(w / weights, 3)} for k, (a, t, w) in sums.items()}


@torch.no_grad()
def stale_laws(model, data, images, sampling, seed: int):  # noqa: ANN001, ANN201
    """The target's law at t + 1 with a rejected token (drawn from the law at t, never the
    sample) at t, for every t < T - 1 of `images`: [n, T - 1, V] float16 on the CPU. Rejected
    drafts go in one position in GAP per pass (GAP passes), so each context holds few, and
    none right above t + 1."""
    io, structural = model.draft_io(), model.layout.structural
    gen = torch.Generator().manual_seed(seed)
    r = data.meta["rows"]
    prompts = default_prompts(model, data.meta["n"], 0)
    out = []
    for i in images:
        seq = torch.from_numpy(data.tokens[i].astype(np.int64))[None]
        feats = torch.from_numpy(data.features[i].astype(np.float32))[None]
        length = seq.shape[1]
        _, q = target_law(io, feats.permute(0, 2, 1, 3).reshape(r, length, -1), r, sampling,
                    structural)
        rejected = draw_other(q[0], seq[0], gen)
        res = torch.zeros(length - 1, model.vocab_size)
        passes = [torch.arange(o, length - 1, GAP) for o in range(GAP)]
        batch = seq.repeat(GAP, 1)
        for k, pos in enumerate(passes):
            batch[k, pos] = rejected[pos]
        f = teacher_features(model, [prompts[i]] * GAP, batch, r == 2)  # [GAP, T, R, D]
        for k, pos in enumerate(passes):
            _, sq = target_law(io, f[k].transpose(0, 1)[:, pos + 1], r, sampling, structural)
            res[pos] = sq[0]
        out.append(res.half())
    return torch.stack(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="drafter-context-data")
    p.add_argument("--images", type=int, default=1536)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16, help="images per step")
    p.add_argument("--positions", type=int, default=64, help="loss positions per image")
    p.add_argument("--held", type=int, default=48, help="held-out images (the last ones)")
    p.add_argument("--heads", default="mlp,attention")
    p.add_argument("--train-images", type=int, default=0,
                   help="train on the first N images only (0: all but the held-out ones)")
    args = p.parse_args()
    model = sp.load_model("builtin")
    sampling = model.defaults
    io, structural = model.draft_io(), model.layout.structural
    folder = Path(args.data)
    prompts = default_prompts(model, args.images, 0)
    t0 = time.perf_counter()
    data = collect(model, prompts, sampling, folder, TrainConfig(images=args.images))
    print(f"data: {data.done} images in {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
    length, r, dev = model.layout.length, data.meta["rows"], model.device
    stride = length // model.layout.grid[0]
    held = np.arange(args.images - args.held, args.images)
    pool = args.train_images or args.images - args.held
    if not 0 < pool <= args.images - args.held:
        raise SystemExit(f"--train-images must be in 1..{args.images - args.held}")
    t0 = time.perf_counter()
    stale_q = stale_laws(model, data, held, sampling, seed=2)
    print(f"stale laws of {len(held)} held-out images ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    results = {}
    for name in args.heads.split(","):
        cfg = HeadConfig(dim=io.dim, width=256, blocks=2, length=length, stride=stride,
                         vocab=model.vocab_size, depth=1)
        torch.manual_seed(0)
        head = (AttentionHead if name == "attention" else PlainHead)(cfg).to(dev)
        opt = torch.optim.AdamW(head.parameters(), lr=2e-3, weight_decay=0.01)
        t0 = time.perf_counter()
        for step in range(args.steps):
            rng = np.random.default_rng([0, step])
            images = rng.integers(0, pool, args.batch)
            picks = torch.from_numpy(np.sort(rng.choice(length - 1, args.positions, False)))
            for g in opt.param_groups:
                g["lr"] = 2e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            loss = step_loss(head, sequences(data, images, stride, io, dev), io, r, sampling,
                             structural, picks.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if (step + 1) % 250 == 0:
                print(f"{name} step {step + 1}: loss {loss.item():.3f}", flush=True)
        head.eval()
        res = measure(head, data, held, stride, io, r, sampling, structural, stale_q, dev)
        res["parameters"] = sum(x.numel() for x in head.parameters())
        res["train_seconds"] = round(time.perf_counter() - t0)
        results[name] = res
        print(f"{name}: {json.dumps(res)}", flush=True)
    print("| head | parameters | agreement alone | x stale^0.5 | after a rejection: alone | "
          "x stale^0.5 | TV alone | TV x stale^0.5 |")
    print("|---|---|---|---|---|---|---|---|")
    st = next(iter(results.values()))["stale"]
    print(f"| none (stale law) | - | {st['agreement']} | - | {st['after_rejection']} | - | "
          f"{st['tv']} | - |")
    for name, res in results.items():
        a, b = res["alone"], res["blend"]
        print(f"| {name} | {res['parameters']:,} | {a['agreement']} | {b['agreement']} | "
              f"{a['after_rejection']} | {b['after_rejection']} | {a['tv']} | {b['tv']} |")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
