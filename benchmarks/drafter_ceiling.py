"""How good a trained drafter must be: lossless sjd with an oracle in the head's place.

    python benchmarks/drafter_ceiling.py [--captions 8] [--windows 16,64]
        [--agreements 0.4,0.5,0.7,0.9,1.0] [--depths 1,2,4,16]

The oracle knows the image AR draws for each caption and seed (sjd draws the same one) and
drafts, at each of the first `depth` slots of every window, AR's token with probability
`agreement` (a coin per slot), else a token that is not AR's. Under Gumbel verification a draft
is accepted exactly when it is AR's token, so this is what a head whose drafts agree with the
target's sample at that rate would commit, whatever its architecture: the step compression
printed is the ceiling of a head with that agreement and depth. For scale: the shipped head's
held-out agreement after a rejection is in its head.json (`after_rejection`), and the stale law
it replaces agrees ~0.38 of the time in the loop. The last line is a JSON of every number.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import speculaas as sp
from speculaas.bench.prompts import builtin_set
from speculaas.decoding import drafting, loop
from speculaas.drafter.head import load_head


class Oracle(drafting.HeadDrafter):
    """A HeadDrafter whose chain is AR's tokens, each right with probability `agreement`."""

    ar: torch.Tensor  # [B, T] the tokens AR draws for the batch's images
    agreement: float = 1.0
    coins = torch.Generator().manual_seed(0)

    def draft(self, memory, img, start, committed, slots, noise, uniforms, forced,  # noqa: ANN001, ANN201
              stale=None):
        depth = min(self.depth, slots)
        length = self.ar.shape[1]
        pos = (start[:, None] + torch.arange(depth)).clamp(max=length - 1)
        right = self.ar[img[:, None], pos]
        wrong = (right + 1) % self.io_vocab
        if stale is not None:  # the waiting draft's guess where it is not AR's token
            guess = stale[:, :depth].argmax(-1)
            wrong = torch.where(guess != right, guess, wrong)
        hit = torch.rand(right.shape, generator=self.coins) < self.agreement
        tokens = torch.where(hit, right, wrong)
        if forced is not None:
            tokens = torch.where(forced[:, :depth] >= 0, forced[:, :depth], tokens)
        laws = torch.nn.functional.one_hot(tokens, self.io_vocab).float()
        return tokens, laws, torch.ones_like(start, dtype=torch.bool)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--captions", type=int, default=8)
    p.add_argument("--windows", default="16,64")
    p.add_argument("--agreements", default="0.4,0.5,0.7,0.9,1.0")
    p.add_argument("--depths", default="1,2,4,16")
    args = p.parse_args()
    model = sp.load_model("builtin")
    head = load_head("shipped", model)
    caps = builtin_set(args.captions)
    seeds = [1000 * i for i in range(len(caps))]
    ar = sp.generate(model, caps, method="ar", seed=seeds, decode_images=False)
    Oracle.ar, Oracle.io_vocab = ar.sequence, model.vocab_size
    real = loop.HeadDrafter
    loop.HeadDrafter = Oracle  # the loop builds its head drafter from this name
    rows = []
    print("| window | depth | agreement | step compr. | single-token iterations |")
    print("|---|---|---|---|---|")
    try:
        for w in [int(x) for x in args.windows.split(",")]:
            base = sp.generate(model, caps, method="sjd", seed=seeds, window=w,
                               decode_images=False)
            rows.append({"window": w, "depth": 0, "agreement": None,
                         "step_compression": round(float(base.step_compression.mean()), 2)})
            print(f"| {w} | no head | - | {rows[-1]['step_compression']:.2f}x | - |")
            for depth in [int(x) for x in args.depths.split(",") if int(x) <= w]:
                for a in [float(x) for x in args.agreements.split(",")]:
                    Oracle.agreement = a
                    out = sp.generate(model, caps, method="sjd", seed=seeds, window=w,
                                      drafter=head, draft_depth=depth, decode_images=False)
                    assert torch.equal(out.tokens, ar.tokens)  # lossless whatever is drafted
                    hist = out.accept_hist.sum(0).float()
                    row = {"window": w, "depth": depth, "agreement": a,
                           "step_compression": round(float(out.step_compression.mean()), 2),
                           "median": round(statistics.median(
                               out.step_compression.tolist()), 2),
                           "single_token_share": round(float(hist[0] / hist.sum()), 3)}
                    rows.append(row)
                    print(f"| {w} | {depth} | {a:g} | {row['step_compression']:.2f}x | "
                          f"{100 * row['single_token_share']:.0f} % |", flush=True)
    finally:
        loop.HeadDrafter = real
    print(json.dumps({"captions": args.captions, "rows": rows}))


if __name__ == "__main__":
    main()
