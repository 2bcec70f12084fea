"""Train the built-in model from scratch: tokenizer, judge, then the AR transformer.

    speculaas train --out runs/builtin            # about an hour on 2 CPU cores
    python -m speculaas.models.builtin.train --out runs/builtin

Everything is seeded; the result is `OUT/builtin.safetensors` (tokenizer + transformer + judge)
and `OUT/training.json` (configs, steps, final losses, git revision). Checkpoints are written to
`OUT/checkpoints/` every few hundred steps. Copy both files into
`src/speculaas/models/builtin/weights/` to ship them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from ..transformer import Decoder, DecoderConfig
from . import vq as vqlib
from .judge import Judge, images_to_tensor, scene_labels
from .scenes import CAPTION_LEN, WORDS, sample_scenes, tokenize_caption


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vq_steps: int = 800
    vq_batch: int = 16
    vq_lr: float = 1e-3
    judge_steps: int = 400
    judge_batch: int = 64
    ar_scenes: int = 25_600
    ar_steps: int = 800
    ar_batch: int = 32
    ar_lr: float = 1e-3
    caption_dropout: float = 0.1
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    checkpoint_every: int = 200
    threads: int = 2


def decoder_config(cfg: TrainConfig, codebook_size: int) -> DecoderConfig:
    return DecoderConfig(
        vocab_in=len(WORDS) + codebook_size,
        vocab_out=codebook_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_len=CAPTION_LEN + 1 + 256 + 16,
    )


def _git_revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_vq(cfg: TrainConfig, out: Path, log: dict) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    vq = vqlib.build_vq().train()
    opt = torch.optim.Adam(vq.parameters(), lr=cfg.vq_lr)
    n_codes = vq.quantize.num_embeddings
    usage = torch.zeros(n_codes)
    bar = tqdm(range(cfg.vq_steps), desc="tokenizer", dynamic_ncols=True)
    for step in bar:
        scenes = sample_scenes(cfg.vq_batch, seed=10_000_000 + step * cfg.vq_batch)
        x = vqlib.to_tensor(np.stack([s.image for s in scenes]))
        for g in opt.param_groups:
            g["lr"] = _cosine_lr(step, cfg.vq_steps, cfg.vq_lr)
        rec, vql, idx = vqlib.train_loss(vq, x)
        (rec + vql).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        usage += torch.bincount(idx, minlength=n_codes).float()
        if step % 50 == 49 and step < cfg.vq_steps * 0.8:
            # Restart dead codes on current encoder outputs so the whole codebook gets used.
            dead = (usage == 0).nonzero().squeeze(1)
            if len(dead):
                with torch.no_grad():
                    z = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)
                    zf = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
                    pick = torch.randint(len(zf), (len(dead),))
                    vq.quantize.embedding.weight[dead] = zf[pick] + 0.01 * torch.randn_like(
                        zf[pick]
                    )
            usage.zero_()
        bar.set_postfix(rec=f"{rec.item():.4f}", vq=f"{vql.item():.4f}")
        if (step + 1) % cfg.checkpoint_every == 0:
            save_file(
                {k: v.contiguous() for k, v in vq.state_dict().items()},
                str(out / "checkpoints" / f"vq_{step + 1}.safetensors"),
            )
    log["vq_final_recon_mse"] = rec.item()
    return vq.eval()


def train_judge(cfg: TrainConfig, log: dict) -> Judge:
    torch.manual_seed(cfg.seed + 1)
    judge = Judge().train()
    opt = torch.optim.Adam(judge.parameters(), lr=2e-3)
    bar = tqdm(range(cfg.judge_steps), desc="judge", dynamic_ncols=True)
    for step in bar:
        scenes = sample_scenes(cfg.judge_batch, seed=20_000_000 + step * cfg.judge_batch)
        logits = judge.logits(images_to_tensor([s.image for s in scenes]))
        labels = scene_labels(scenes)
        loss = sum(F.cross_entropy(logits[k], labels[k]) for k in logits)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    log["judge_final_loss"] = loss.item()
    return judge.eval()


def tokenize_dataset(cfg: TrainConfig, vq) -> torch.Tensor:
    """[ar_scenes, CAPTION_LEN + 1 + 256] ids: caption words, image start, image codes."""
    rows = []
    for start in tqdm(range(0, cfg.ar_scenes, 256), desc="tokenize scenes", dynamic_ncols=True):
        scenes = sample_scenes(min(256, cfg.ar_scenes - start), seed=30_000_000 + start)
        codes = vqlib.encode(vq, np.stack([s.image for s in scenes])) + len(WORDS)
        caps = torch.tensor([tokenize_caption(s.caption) for s in scenes])
        rows.append(torch.cat([caps, codes], 1))
    return torch.cat(rows)


def train_ar(cfg: TrainConfig, data: torch.Tensor, out: Path, log: dict) -> Decoder:
    torch.manual_seed(cfg.seed + 2)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    model = Decoder(decoder_config(cfg, vqlib.VQ_KWARGS["num_embeddings"])).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.ar_lr,
        betas=(0.9, 0.95),
    )
    null = torch.tensor(tokenize_caption(None))
    n_text = len(WORDS)
    bar = tqdm(range(cfg.ar_steps), desc="transformer", dynamic_ncols=True)
    for step in bar:
        ids = data[torch.randint(len(data), (cfg.ar_batch,), generator=gen)].clone()
        drop = torch.rand(cfg.ar_batch, generator=gen) < cfg.caption_dropout
        ids[drop, : CAPTION_LEN + 1] = null  # caption dropout: learn the unconditional model too
        for g in opt.param_groups:
            g["lr"] = _cosine_lr(step, cfg.ar_steps, cfg.ar_lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        # Position CAPTION_LEN (the image-start token) predicts the first image code.
        target = ids[:, CAPTION_LEN + 1 :] - n_text
        loss = F.cross_entropy(
            logits[:, CAPTION_LEN:].float().reshape(-1, logits.shape[-1]), target.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % cfg.checkpoint_every == 0:
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()},
                str(out / "checkpoints" / f"ar_{step + 1}.safetensors"),
            )
    log["ar_final_loss"] = loss.item()
    return model.eval()


def train(cfg: TrainConfig, out: Path) -> Path:
    torch.set_num_threads(cfg.threads)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    log: dict = {}
    revision = _git_revision()  # of the code that trains, not of whatever HEAD is at the end
    t0 = time.time()
    vq = train_vq(cfg, out, log)
    log["vq_seconds"] = round(time.time() - t0, 1)
    judge = train_judge(cfg, log)
    data = tokenize_dataset(cfg, vq)
    t1 = time.time()
    model = train_ar(cfg, data, out, log)
    log["ar_seconds"] = round(time.time() - t1, 1)
    tensors = {f"vq.{k}": v for k, v in vq.state_dict().items()}
    tensors |= {f"ar.{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"judge.{k}": v for k, v in judge.state_dict().items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "builtin.safetensors"))
    record = {
        "train_config": asdict(cfg),
        "decoder_config": decoder_config(cfg, vqlib.VQ_KWARGS["num_embeddings"]).to_dict(),
        "vq_config": vqlib.VQ_KWARGS,
        "final": log,
        "total_seconds": round(time.time() - t0, 1),
        "git_revision": revision,
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2))
    return out / "builtin.safetensors"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    for name, field in TrainConfig.__dataclass_fields__.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=type(field.default), default=field.default
        )
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
    print(train(cfg, args.out))


if __name__ == "__main__":
    main()
