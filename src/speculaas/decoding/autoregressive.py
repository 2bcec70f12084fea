"""Plain autoregressive decoding: the reference every speculative method is measured against.

Token t of an image is the Gumbel-max sample argmax(log target_t + g_t) under the image's noise
(sampling.exponential_noise, keyed by the first draw of its stream). Lossless speculative decoding
commits the same argmax at every position (Gumbel verification, decoding/verify.py), so for one
seed it draws the very tokens this loop draws, whatever its window or batch.
"""

from __future__ import annotations

import torch

from ..acceptance.functional import entropy
from ..config import SamplingConfig
from ..models.base import ImageModel, Session
from ..sampling import exponential_noise, gumbel_argmax, image_keys, target_probs
from .result import DecodeResult


class AutoregressiveLoop:
    """One token per image per forward; step(t) decodes position t of every image (the window
    policy times one step to price plain AR against speculation). keys: the images' noise keys
    when their streams' first draw was already taken (a speculative decode falling back to AR)."""

    def __init__(self, model: ImageModel, session: Session, sampling: SamplingConfig,
                 generators: list[torch.Generator], progress=None,  # noqa: ANN001
                 keys: torch.Tensor | None = None) -> None:
        self.model, self.session, self.sampling = model, session, sampling
        self.generators, self.progress = generators, progress
        batch, length, dev = session.batch_size, model.layout.length, model.device
        self.images = torch.arange(batch, device=dev)
        self.seq = torch.zeros(batch, length, dtype=torch.long, device=dev)
        self.ent = torch.zeros(batch, length, device=dev)
        self.forced = model.layout.forced.to(dev)
        self.keys = image_keys(generators, dev) if keys is None else keys

    def step(self, t: int) -> None:
        dev, batch = self.model.device, len(self.generators)
        prev = self.seq[:, max(t - 1, 0) : max(t - 1, 0) + 1]
        cond, uncond = self.session.forward(prev.clone(), torch.full((batch,), t, device=dev),
                                            self.images, max_offset=t)
        q = target_probs(cond, uncond, self.sampling, self.model.layout.structural)[:, 0]
        pos = torch.full((batch, 1), t, device=dev)
        tok = gumbel_argmax(q, exponential_noise(self.keys, pos, q.shape[-1])[:, 0])
        self.seq[:, t] = torch.where(self.forced[t] >= 0, self.forced[t], tok)
        self.ent[:, t] = entropy(q)
        if self.progress is not None:
            self.progress.update(batch)

    def result(self) -> DecodeResult:
        (batch, length), dev = self.seq.shape, self.seq.device
        steps = torch.arange(length, device=dev).expand(batch, -1).clone()
        return DecodeResult(tokens=self.seq, forward_passes=torch.full((batch,), length,
                                                                       device=dev),
                            commit_step=steps, drafted=torch.zeros_like(self.seq, dtype=torch.bool),
                            entropy=self.ent, accept_hist=torch.full((batch, 1), length,
                                                                     device=dev),
                            iterations=length,
                            window_hist=torch.tensor([[0, length]] * batch, device=dev))


@torch.inference_mode()
def autoregressive_decode(model: ImageModel, session: Session, sampling: SamplingConfig,
                          generators: list[torch.Generator], progress=None,  # noqa: ANN001
                          keys: torch.Tensor | None = None) -> DecodeResult:
    loop = AutoregressiveLoop(model, session, sampling, generators, progress, keys)
    for t in range(model.layout.length):
        loop.step(t)
    return loop.result()
