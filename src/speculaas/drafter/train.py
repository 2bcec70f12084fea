"""Self-distillation of a draft head: no data set, only the target.

1. collect: the target draws its own images (plain AR under the sampling the head will serve),
   then one teacher-forced forward over each records the feature that decided every position
   (memory-mapped float16 on disk, written chunk by chunk: an interrupted run resumes). For a
   stale head, more teacher-forced passes put a rejected draft (drawn, as in the loop, from a
   stale law, never the sample) at one position in STALE_GAP and record the stale feature one
   position on: what the decoding loop holds after a rejection.
2. fit: from the true feature of position j and the true tokens, the head runs `unroll` chain
   steps; step k is trained towards the target's law of position j + 1 + k (soft labels: the
   law that maximises agreement with the target's Gumbel sample is the target's own) and its
   feature towards the target's. Minibatches are a function of (seed, step), and a checkpoint
   holds the head and the optimiser, so a resumed run ends on the same weights.
3. prior: tokens per iteration at each window on held-out prompts, what window="auto"
   weighs with this head.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import SamplingConfig, TrainConfig
from ..models.base import ImageModel
from ..sampling import combine_cfg, target_probs
from .head import DraftHead, HeadConfig, save_head

DATA, CHECKPOINT = "data", "train.pt"
PRIOR_WINDOWS = (2, 4, 8, 16, 32, 64)
# One rejected draft in 16 positions per pass (two passes, offset by half): each stale feature's
# context holds few wrong tokens, as after a rejection in the loop (one).
STALE_GAP = 16
STALE_SHARE = 0.75  # chains of a stale head that start after a rejection


def default_prompts(model: ImageModel, n: int, seed: int) -> list:
    """Prompts the target distils from when none are given: the built-in model's caption
    grammar (scenes no benchmark or training set uses), the tiny model's and LlamaGen c2i's
    classes (a t2i checkpoint needs a prompt file)."""
    if model.name == "builtin":
        from ..models.builtin.scenes import render_scene

        base = 60_000_000 + 100_000 * seed  # below the bench set (9e7), above AR training (4e7)
        return [render_scene(base + i).caption for i in range(n)]
    if model.name == "tiny":
        classes = getattr(model, "num_classes", 0)
        return [i % classes for i in range(n)] if classes else [None] * n
    gpt = getattr(model, "gpt", None)
    if model.name == "llamagen" and gpt.model_type == "c2i":
        classes = gpt.cls_embedding.embedding_table.num_embeddings - 1  # the last: unconditional
        return [int(c) for c in np.random.default_rng(seed).integers(0, classes, n)]
    raise ValueError(f"model {model.name!r} has no built-in prompts: give a prompt file "
                     "(--prompts FILE, one prompt per line)")


def _stride(model: ImageModel) -> int:
    return model.layout.length // model.layout.grid[0]


def stale_positions(model: ImageModel) -> list[int]:
    """Positions s given a rejected draft in the stale passes (s and s + 1 free), pass by pass."""
    forced = model.layout.forced.tolist()
    length = len(forced)
    return [s for o in (0, STALE_GAP // 2) for s in range(o, length - 1, STALE_GAP)
            if forced[s] < 0 and forced[s + 1] < 0]


class Data:
    """The memory-mapped record of one collection: tokens [N, T] int32, features [N, T, R, D]
    float16 (R = 2 with guidance: cond, uncond), and data.json (shape, how many are done). With
    stale positions [P]: the rejected drafts there [N, P] int32 and the stale features one
    position on [N, P, R, D] float16."""

    def __init__(self, folder: Path, n: int, length: int, rows: int, dim: int,
                 meta: dict, stale: list[int] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.meta_path = folder, folder / "data.json"
        meta = {**meta, "n": n, "length": length, "rows": rows, "dim": dim,
                "stale_positions": stale or []}
        old = json.loads(self.meta_path.read_text()) if self.meta_path.is_file() else None
        fresh = old is None or {k: v for k, v in old.items() if k != "done"} != meta
        self.meta = {**meta, "done": 0 if fresh else int(old["done"])}
        mode = "w+" if fresh else "r+"
        self.tokens = np.lib.format.open_memmap(folder / "tokens.npy", mode, np.int32, (n, length))
        self.features = np.lib.format.open_memmap(folder / "features.npy", mode, np.float16,
                                                  (n, length, rows, dim))
        self.stale_pos = np.asarray(stale or [], dtype=np.int64)
        if stale:
            p = len(stale)
            self.stale_tok = np.lib.format.open_memmap(folder / "stale_tokens.npy", mode,
                                                       np.int32, (n, p))
            self.stale = np.lib.format.open_memmap(folder / "stale_features.npy", mode,
                                                   np.float16, (n, p, rows, dim))
        if fresh:
            self._save_meta()

    @property
    def done(self) -> int:
        return self.meta["done"]

    def add(self, tokens: torch.Tensor, features: torch.Tensor,
            stale: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        lo, hi = self.done, self.done + len(tokens)
        self.tokens[lo:hi] = tokens.cpu().numpy()
        self.features[lo:hi] = features.cpu().to(torch.float16).numpy()
        arrays = [self.tokens, self.features]
        if stale is not None:
            self.stale_tok[lo:hi] = stale[0].cpu().numpy()
            self.stale[lo:hi] = stale[1].cpu().to(torch.float16).numpy()
            arrays += [self.stale_tok, self.stale]
        for a in arrays:
            a.flush()
        self.meta["done"] = hi
        self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.meta_path)


@torch.inference_mode()
def teacher_features(model: ImageModel, prompts: list, sequence: torch.Tensor,
                     cfg: bool) -> torch.Tensor:
    """One teacher-forced forward over generated sequences [b, T]: the feature that decided
    every position, [b, T, R, D] (R = 2 with guidance)."""
    b, length = sequence.shape
    session = model.start(list(prompts), cfg=cfg)
    session.record_features = True
    dev = model.device
    inputs = torch.cat([sequence.new_zeros(b, 1), sequence[:, :-1]], 1).to(dev)
    zero = torch.zeros(b, dtype=torch.long, device=dev)
    session.forward(inputs, zero, torch.arange(b, device=dev), max_offset=0)
    cond, uncond = session.features
    parts = [cond] if not cfg else [cond, uncond]
    return torch.stack(parts, 2).float()


def draw_other(q: torch.Tensor, taken: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A draw from the law q [..., V] other than `taken` [...]: a rejected draft, never the
    sample (where q is that one token, any other token, uniformly)."""
    q = q.scatter(-1, taken[..., None], 0.0)
    others = torch.ones_like(q).scatter(-1, taken[..., None], 0.0)
    q = torch.where(q.sum(-1, keepdim=True) > 0, q, others)  # one-token laws: any other
    return torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=gen).view(q.shape[:-1])


def target_law(io, feats: torch.Tensor, rows: int, sampling: SamplingConfig,  # noqa: ANN001
               structural: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [b * rows, ..., dim] (rows cond, uncond per chain) through the target's output
    head -> (its logits [b, rows, ..., V], the sampled law q [b, ..., V]: guidance, temperature,
    top-k/p and the structural tokens, as the target draws)."""
    logits = io.logits(feats.to(io.dtype)).float()
    logits = logits.view(-1, rows, *logits.shape[1:])
    q = target_probs(logits[:, 0], logits[:, 1] if rows == 2 else None, sampling, structural,
                     check=False)
    return logits, q


def distill_loss(io, h: torch.Tensor, true: torch.Tensor, rows: int,  # noqa: ANN001
                 sampling: SamplingConfig, structural: tuple[int, ...]):  # noqa: ANN201
    """The head's loss against the target's: its features h and the target's true ones
    [b * rows, ..., dim] (rows cond, uncond per chain) -> (loss [b, ...], the head's logits
    [b, rows, ..., V], the target's law q [b, ..., V]). Cross-entropy of the head's guided law
    towards q (soft labels), half that of each row's law towards the target's row, and a
    smooth-L1 pull of the feature towards the target's."""
    with torch.no_grad():
        tl, q = target_law(io, true, rows, sampling, structural)
        q_rows = tl.softmax(-1)
    hl = io.logits(h.to(io.dtype)).float()
    hl = hl.view(-1, rows, *hl.shape[1:])
    guided = combine_cfg(hl[:, 0], hl[:, 1] if rows == 2 else None,
                         sampling.cfg_scale) / sampling.temperature
    if structural:
        guided[..., list(structural)] = -1e4
    ce = -(q * guided.log_softmax(-1)).sum(-1)
    ce_rows = -(q_rows * hl.log_softmax(-1)).sum(-1).mean(1)
    feat = F.smooth_l1_loss(h, true, reduction="none").mean(-1)
    feat = feat.view(-1, rows, *feat.shape[1:]).mean(1)
    return ce + 0.5 * ce_rows + feat, hl, q


def stale_features(model: ImageModel, prompts: list, sequence: torch.Tensor,
                   features: torch.Tensor, positions: list[int], sampling: SamplingConfig,
                   seed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejected drafts at `positions` [P] of sequences [b, T] and the stale features one
    position on, [b, P] and [b, P, R, D] (features [b, T, R, D]: the true ones). As in the
    loop, a rejected draft was drawn from a stale law: per STALE_GAP offset, one teacher-forced
    pass with a token other than the sample one position earlier gives the stale law at each
    position, the rejected draft is drawn from it (never the sample), and a second pass with
    that draft in place gives the stale feature one position on."""
    io, structural = model.draft_io(), model.layout.structural
    gen = torch.Generator().manual_seed(int(np.random.default_rng(seed).integers(1 << 62)))
    r, forced = features.shape[2], model.layout.forced.cpu()
    seq0 = sequence.cpu().long()

    def reject(feats: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
        """A draw from the law of feats [b, n, R, D] other than `taken` [b, n]."""
        logits = io.logits(feats.to(model.device, io.dtype)).float().cpu()
        q = target_probs(logits[:, :, 0], logits[:, :, 1] if r == 2 else None, sampling,
                         structural, check=False).nan_to_num(0.0)
        return draw_other(q, taken, gen)

    def forward(seq: torch.Tensor) -> torch.Tensor:
        return teacher_features(model, prompts, seq.to(sequence.device), r == 2).cpu()

    drafts = torch.zeros(len(sequence), len(positions), dtype=torch.long)
    stale = torch.zeros(len(sequence), len(positions), *features.shape[2:])
    for o in sorted({p % STALE_GAP for p in positions}):
        cols = torch.tensor([i for i, p in enumerate(positions) if p % STALE_GAP == o])
        pos = torch.tensor(positions)[cols]
        earlier = pos[(pos > 0) & (forced[(pos - 1).clamp(min=0)] < 0)] - 1
        seq = seq0.clone()
        seq[:, earlier] = reject(features[:, earlier].cpu(), seq0[:, earlier])
        law_feats = forward(seq)[:, pos] if len(earlier) else features[:, pos].cpu()
        d = reject(law_feats, seq0[:, pos])
        seq = seq0.clone()
        seq[:, pos] = d
        drafts[:, cols] = d
        stale[:, cols] = forward(seq)[:, pos + 1]
    return drafts, stale


def collect(model: ImageModel, prompts: list, sampling: SamplingConfig, folder: Path,
            cfg: TrainConfig, progress: bool = True) -> Data:
    """Step 1: the target's own samples and features (and a stale head's stale features),
    resumed where a run stopped."""
    from ..api import generate

    io = model.draft_io()
    rows = 2 if sampling.uses_cfg else 1
    stale = stale_positions(model) if cfg.stale else None
    data = Data(folder, len(prompts), model.layout.length, rows, io.dim,
                {"fingerprint": io.fingerprint, "sampling": vars(sampling), "seed": cfg.seed},
                stale)
    bar = _bar(progress, len(prompts), data.done, "target samples", "img")
    while data.done < len(prompts):
        lo = data.done
        chunk = prompts[lo : lo + cfg.batch]
        seeds = [cfg.seed * 10_000_000 + lo + i for i in range(len(chunk))]
        out = generate(model, chunk, method="ar", seed=seeds, decode_images=False,
                       temperature=sampling.temperature, top_k=sampling.top_k,
                       top_p=sampling.top_p, cfg_scale=sampling.cfg_scale)
        feats = teacher_features(model, chunk, out.sequence, sampling.uses_cfg)
        extra = (stale_features(model, chunk, out.sequence, feats, stale, sampling,
                                [cfg.seed, lo]) if stale else None)
        data.add(out.sequence, feats, extra)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return data


def _bar(progress: bool, total: int, initial: int, desc: str, unit: str):  # noqa: ANN202
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


class Distiller:
    """Step 2: the losses of a minibatch of chains, and agreement on held-out images."""

    def __init__(self, model: ImageModel, head: DraftHead, data: Data,
                 sampling: SamplingConfig, unroll: int) -> None:
        self.model, self.head, self.data, self.sampling = model, head, data, sampling
        self.io, self.unroll = model.draft_io(), unroll
        self.stride, self.length = head.cfg.stride, model.layout.length
        self.free = (model.layout.forced < 0).to(model.device)
        self.structural = model.layout.structural

    def starts(self, rng: np.random.Generator, images: np.ndarray,
               last_start: int) -> tuple[np.ndarray, np.ndarray]:
        """Chain starts for `images`: for a stale head STALE_SHARE of them at a stale position
        (the chain's first step reads that stale feature), the rest anywhere; -> starts and
        the stale index of each (-1: none)."""
        starts = rng.integers(0, last_start + 1, len(images))
        index = np.full(len(images), -1)
        usable = self.stale_starts(last_start)
        if len(usable):
            pick = rng.random(len(images)) < STALE_SHARE
            index = np.where(pick, rng.choice(usable, len(images)), -1)
            starts = np.where(pick, self.data.stale_pos[np.maximum(index, 0)], starts)
        return starts, index

    def stale_starts(self, last_start: int) -> np.ndarray:
        """Indices of the stale positions a chain may start at (none for a plain head)."""
        if not self.head.cfg.stale:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.data.stale_pos <= last_start)

    def batch(self, images: np.ndarray, starts: np.ndarray,
              stale: np.ndarray | None = None):  # noqa: ANN201
        """Chains from (image, j): tokens and features of positions j .. j + unroll, the tokens
        one row above positions j + 1 .. j + unroll (0 where not committed before the chain),
        j, and with stale indices [b] (-1: none) the stale feature of j + 1, the rejected draft
        at j and which chains have them."""
        dev = self.model.device
        span = starts[:, None] + np.arange(self.unroll + 1)
        tokens = torch.from_numpy(self.data.tokens[images[:, None], span].astype(np.int64))
        feats = torch.from_numpy(self.data.features[images[:, None], span].astype(np.float32))
        above_pos = np.clip(span[:, 1:] - self.stride, 0, None)
        above = torch.from_numpy(self.data.tokens[images[:, None], above_pos].astype(np.int64))
        out = [tokens.to(dev), feats.to(dev), above.to(dev), torch.from_numpy(starts).to(dev)]
        if stale is not None and self.head.cfg.stale:
            i = np.maximum(stale, 0)
            sf = torch.from_numpy(self.data.stale[images, i].astype(np.float32))
            st = torch.from_numpy(self.data.stale_tok[images, i].astype(np.int64))
            out.append((sf.to(dev), st.to(dev), torch.from_numpy(stale >= 0).to(dev)))
        return out

    def run(self, tokens: torch.Tensor, feats: torch.Tensor, above_tokens: torch.Tensor,
            starts: torch.Tensor, stale: tuple | None = None):  # noqa: ANN201
        """-> (loss, per-step agreement of Gumbel samples [unroll], per-step TV [unroll])."""
        b, r = tokens.shape[0], feats.shape[2]
        io, head = self.io, self.head
        emb = io.embed(tokens).float()  # [b, U + 1, D]
        h = feats[:, 0].reshape(b * r, -1)
        losses, agree, tvs = [], [], []
        for k in range(self.unroll):
            pos = starts + 1 + k
            above_pos = pos - self.stride
            has_above = (above_pos >= 0) & (above_pos < starts + 1)
            above = io.embed(above_tokens[:, k]).float()
            stale_in = None
            if stale is not None and k == 0:
                sf, st, has = stale
                stale_in = (sf.reshape(b * r, -1), io.embed(st).float().repeat_interleave(r, 0),
                            has.repeat_interleave(r, 0))
            h = head(h, emb[:, k].repeat_interleave(r, 0), above.repeat_interleave(r, 0),
                     has_above.repeat_interleave(r, 0), pos.repeat_interleave(r, 0), stale_in)
            true = feats[:, k + 1].reshape(b * r, -1)
            loss, hl, q = distill_loss(io, h, true, r, self.sampling, self.structural)
            free = self.free[pos.clamp(max=self.length - 1)].float()
            losses.append((loss * free).sum() / free.sum().clamp(min=1))
            with torch.no_grad():
                p = target_probs(hl[:, 0], hl[:, 1] if r == 2 else None, self.sampling,
                                 self.structural, check=False)
                noise = torch.empty_like(q).exponential_()
                agree.append(((p / noise).argmax(-1) == (q / noise).argmax(-1)).float().mean())
                tvs.append(0.5 * (p - q).abs().sum(-1).mean())
        return torch.stack(losses).mean(), torch.stack(agree), torch.stack(tvs)


def fit(model: ImageModel, data: Data, sampling: SamplingConfig, cfg: TrainConfig,
        folder: Path, progress: bool = True, log=print) -> tuple[DraftHead, dict]:  # noqa: ANN001
    """Step 2, resumed from folder/train.pt when one exists for the same settings."""
    io = model.draft_io()
    hcfg = HeadConfig(dim=io.dim, width=cfg.width, blocks=cfg.blocks,
                      length=model.layout.length, stride=_stride(model),
                      vocab=model.vocab_size, depth=cfg.depth,
                      stale=cfg.stale and len(data.stale_pos) > 0)
    torch.manual_seed(cfg.seed)
    head = DraftHead(hcfg).to(model.device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.01)
    n = data.meta["n"]
    held = max(1, int(n * cfg.holdout)) if cfg.holdout > 0 and n > 1 else 0
    train_n = n - held
    # What decides the weights (not the use-time depth, the prior or the checkpoint interval).
    use_time = ("depth", "prior_prompts", "checkpoint_every")
    settings = {"train": {k: v for k, v in asdict(cfg).items() if k not in use_time},
                "head": {k: v for k, v in asdict(hcfg).items() if k != "depth"},
                "data": data.meta}
    ckpt_path, start, history = folder / CHECKPOINT, 0, []
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, map_location=model.device, weights_only=False)
        if ckpt.get("settings") == settings:
            head.load_state_dict(ckpt["head"])
            opt.load_state_dict(ckpt["opt"])
            start, history = ckpt["step"], ckpt["history"]
            log(f"resuming training at step {start}/{cfg.steps}")
        else:
            log(f"{ckpt_path} was written with other settings; starting over")
    dist = Distiller(model, head, data, sampling, cfg.unroll)
    last_start = model.layout.length - 1 - cfg.unroll
    for p in model_params(model):
        p.requires_grad_(False)
    bar = _bar(progress, cfg.steps, start, "training", "step")
    head.train()
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        rng = np.random.default_rng([cfg.seed, step])
        images = rng.integers(0, train_n, cfg.chains)
        starts, stale = dist.starts(rng, images, last_start)
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, agree, _ = dist.run(*dist.batch(images, starts, stale))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", agree=f"{agree[0].item():.2f}")
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            history.append({"step": done, "loss": round(loss.item(), 4)})
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"settings": settings, "head": head.state_dict(),
                        "opt": opt.state_dict(), "step": done, "history": history}, tmp)
            tmp.replace(ckpt_path)
    if bar is not None:
        bar.close()
    head.eval()
    report = {"history": history, "seconds_this_run": round(time.perf_counter() - t0, 1)}
    if held:
        report["heldout"] = evaluate(dist, np.arange(train_n, n), cfg, last_start)
    return head, report


def model_params(model: ImageModel) -> list[torch.nn.Parameter]:
    return [p for m in vars(model).values() if isinstance(m, torch.nn.Module)
            for p in m.parameters()]


@torch.no_grad()
def evaluate(dist: Distiller, images: np.ndarray, cfg: TrainConfig, last_start: int) -> dict:
    """Agreement of the head's Gumbel sample with the target's and total variation, per chain
    step, over chains of held-out images starting anywhere; for a stale head also the first
    step's after a rejection (chains at stale positions, with and without the stale feature)."""
    rng = np.random.default_rng([cfg.seed, 1 << 30])
    count = min(2048, len(images) * 64)
    imgs = images[rng.integers(0, len(images), count)]
    starts = rng.integers(0, last_start + 1, count)
    report = _agreement(dist, imgs, starts, None)
    usable = dist.stale_starts(last_start)
    if len(usable):
        index = rng.choice(usable, count)
        starts = dist.data.stale_pos[index]
        with_stale = _agreement(dist, imgs, starts, index)
        without = _agreement(dist, imgs, starts, np.full(count, -1))
        report["after_rejection"] = {"agreement": with_stale["agreement"][0],
                                     "without_stale_feature": without["agreement"][0]}
    return report


def _agreement(dist: Distiller, imgs: np.ndarray, starts: np.ndarray,
               stale: np.ndarray | None) -> dict:
    agree, tv = [], []
    dist.head.eval()
    for lo in range(0, len(imgs), 256):
        sl = slice(lo, lo + 256)
        _, a, t = dist.run(*dist.batch(imgs[sl], starts[sl],
                                       None if stale is None else stale[sl]))
        agree.append(a)
        tv.append(t)
    return {"agreement": [round(x, 3) for x in torch.stack(agree).mean(0).tolist()],
            "tv": [round(x, 3) for x in torch.stack(tv).mean(0).tolist()]}


def measure_prior(model: ImageModel, head: DraftHead, prompts: list, sampling: SamplingConfig,
                  log=print) -> dict:  # noqa: ANN001
    """Step 3: tokens per iteration at each fixed window with the head, sjd (lossless) and
    csd at delta 0.65 (relaxed), on `prompts`, two seeds each."""
    from ..api import generate

    prior: dict[str, dict[str, float]] = {"lossless": {"1": 1.0}, "relaxed": {"1": 1.0}}
    seeds = list(range(len(prompts)))
    for kind, method, opts in (("lossless", "sjd", {}), ("relaxed", "csd", {"delta": 0.65})):
        for w in PRIOR_WINDOWS:
            out = generate(model, prompts, method=method, seed=seeds, window=w, drafter=head,
                           decode_images=False, temperature=sampling.temperature,
                           top_k=sampling.top_k, top_p=sampling.top_p,
                           cfg_scale=sampling.cfg_scale, **opts)
            steps = out.forward_passes.float().mean().item()
            prior[kind][str(w)] = round(model.layout.length / steps, 3)
        log(f"prior ({method}): {prior[kind]}")
    return prior


def train_drafter(model: ImageModel, out: str | Path, cfg: TrainConfig,
                  sampling: SamplingConfig, prompts: list | None = None,
                  progress: bool = True, log=print) -> Path:  # noqa: ANN001
    """All three steps; writes head.safetensors and head.json into `out` (and keeps data/ and
    train.pt there, for a resume)."""
    io = model.draft_io()
    if io is None:
        raise ValueError(f"model {model.name!r} does not give a draft head its features")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    held_prompts = cfg.prior_prompts
    if prompts is None:
        prompts = default_prompts(model, cfg.images + held_prompts, cfg.seed)
    elif len(prompts) < cfg.images + held_prompts:
        reps = -(-(cfg.images + held_prompts) // len(prompts))
        prompts = (list(prompts) * reps)[: cfg.images + held_prompts]
    model.check_prompts(prompts)
    train_prompts, prior_prompts = prompts[: cfg.images], prompts[cfg.images :]
    t0 = time.perf_counter()
    data = collect(model, train_prompts, sampling, folder / DATA, cfg, progress)
    t1 = time.perf_counter()
    head, report = fit(model, data, sampling, cfg, folder, progress, log)
    t2 = time.perf_counter()
    record = {"model": model.name, "fingerprint": io.fingerprint, "sampling": vars(sampling),
              "training": {**asdict(cfg), **report,
                           "collect_seconds_this_run": round(t1 - t0, 1)}}
    save_head(head, folder, record)
    if prior_prompts:
        record["prior"] = measure_prior(model, head, prior_prompts, sampling, log)
    record["training"]["prior_seconds"] = round(time.perf_counter() - t2, 1)
    save_head(head, folder, record)
    return folder
