"""Plain autoregressive decoding: the reference every speculative method is measured against."""

from __future__ import annotations

import torch

from ..acceptance.functional import entropy
from ..config import SamplingConfig
from ..models.base import ImageModel, Session
from ..sampling import sample_with_uniform, target_probs
from .result import DecodeResult, draw


@torch.inference_mode()
def autoregressive_decode(model: ImageModel, session: Session, sampling: SamplingConfig,
                          generators: list[torch.Generator], progress=None) -> DecodeResult:  # noqa: ANN001
    batch, length, dev = session.batch_size, model.layout.length, model.device
    images = torch.arange(batch, device=dev)
    seq = torch.zeros(batch, length, dtype=torch.long, device=dev)
    ent = torch.zeros(batch, length, device=dev)
    forced = model.layout.forced.to(dev)
    for t in range(length):
        prev = seq[:, max(t - 1, 0) : max(t - 1, 0) + 1]
        cond, uncond = session.forward(prev.clone(), torch.full((batch,), t, device=dev), images)
        q = target_probs(cond, uncond, sampling, model.layout.structural)[:, 0]
        tok = sample_with_uniform(q, draw(generators, images, 1, dev)[:, 0])
        seq[:, t] = torch.where(forced[t] >= 0, forced[t], tok)
        ent[:, t] = entropy(q)
        if progress is not None:
            progress.update(batch)
    steps = torch.arange(length, device=dev).expand(batch, -1).clone()
    return DecodeResult(tokens=seq, forward_passes=torch.full((batch,), length, device=dev),
                        commit_step=steps, drafted=torch.zeros_like(seq, dtype=torch.bool),
                        entropy=ent, accept_hist=torch.full((batch, 1), length, device=dev),
                        iterations=length)
