"""The built-in image tokenizer: transformers' `JanusVQVAE` (the VQ-16 design of LlamaGen and
Janus) at a small size, downsampling 4: a 64x64 image is a 16x16 grid of codes.

`JanusVQVAE.forward` decodes from indices, so its encoder gets no gradient; training goes through
encoder -> l2-normalised nearest code -> decoder with a straight-through estimator instead, the
same lookup `JanusVQVAE.decode` uses (cosine similarity on l2-normalised codes).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.janus.configuration_janus import JanusVQVAEConfig
from transformers.models.janus.modeling_janus import JanusVQVAE

from ..base import to_uint8

VQ_KWARGS = dict(
    embed_dim=8, num_embeddings=4096, latent_channels=64, base_channels=32,
    channel_multiplier=[1, 2, 2], num_res_blocks=1, num_patches=16,
    projection_dim=32, image_token_embed_dim=32,
)


def build_vq(**overrides) -> JanusVQVAE:
    return JanusVQVAE(JanusVQVAEConfig(**{**VQ_KWARGS, **overrides})).eval()


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _latents(vq: JanusVQVAE, x: torch.Tensor) -> torch.Tensor:
    return F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)  # [B, d, h, w]


def codebook(vq: JanusVQVAE) -> torch.Tensor:
    """The codes as decoding uses them: l2-normalised, [num_embeddings, embed_dim]."""
    return F.normalize(vq.quantize.embedding.weight, dim=1)


@torch.no_grad()
def encode(vq: JanusVQVAE, images: np.ndarray) -> torch.Tensor:
    """uint8 [B, 64, 64, 3] -> tokens [B, 256] in raster order."""
    z = _latents(vq, to_tensor(images).to(vq.quantize.embedding.weight.device))
    idx = torch.einsum("bdhw,nd->bhwn", z, codebook(vq)).argmax(-1)
    return idx.flatten(1)


@torch.no_grad()
def decode(vq: JanusVQVAE, tokens: torch.Tensor) -> np.ndarray:
    """tokens [B, 256] -> uint8 [B, 64, 64, 3]."""
    return to_uint8(vq.decode(tokens.long()))


def train_loss(vq: JanusVQVAE, x: torch.Tensor, beta: float = 0.25):
    """Reconstruction + codebook + commitment losses with a straight-through estimator.

    Returns (reconstruction mse, vq loss, code indices [B*h*w]).
    """
    z = _latents(vq, x)
    b, d, h, w = z.shape
    zf = z.permute(0, 2, 3, 1).reshape(-1, d)
    cb = codebook(vq)
    idx = (zf @ cb.T).argmax(1)
    zq = cb[idx]
    vq_loss = F.mse_loss(zq, zf.detach()) + beta * F.mse_loss(zf, zq.detach())
    zq = zf + (zq - zf).detach()
    recon = vq.decoder(vq.post_quant_conv(zq.view(b, h, w, d).permute(0, 3, 1, 2)))
    return F.mse_loss(recon, x), vq_loss, idx
