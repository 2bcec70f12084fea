"""Pixel decoder of the Chameleon VQGAN, loaded from the `vqgan.ckpt` + `vqgan.yaml` pair that
Lumina-mGPT and Anole ship (transformers' `ChameleonVQVAE` encodes only).

The architecture is the taming-transformers decoder the checkpoint was trained with: codebook
lookup, `post_quant_conv`, then conv_in, a middle block (res, attention, res), upsampling levels
of residual blocks and a GroupNorm/SiLU/conv head. Parameter names match the checkpoint's
`decoder.*`, `post_quant_conv.*` and `quantize.embedding.weight`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (m(y).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).view(b, c, h, w)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    def __init__(self, ch: int, out_ch: int, ch_mult: list[int], num_res_blocks: int,
                 attn_resolutions: list[int], z_channels: int, resolution: int, **_) -> None:
        super().__init__()
        levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (levels - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        up = []
        for level in reversed(range(levels)):
            stage = nn.Module()
            block_out = ch * ch_mult[level]
            blocks, attns = [], []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if res in attn_resolutions:
                    attns.append(AttnBlock(block_in))
            stage.block, stage.attn = nn.ModuleList(blocks), nn.ModuleList(attns)
            if level != 0:
                stage.upsample = Upsample(block_in)
                res *= 2
            up.insert(0, stage)
        self.up = nn.ModuleList(up)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for level in reversed(range(len(self.up))):
            stage = self.up[level]
            for i, block in enumerate(stage.block):
                h = block(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if level != 0:
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VQGANDecoder(nn.Module):
    """codes [B, h, w] -> pixels [B, 3, H, W] in about [-1, 1]."""

    def __init__(self, n_embed: int, embed_dim: int, ddconfig: dict) -> None:
        super().__init__()
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(n_embed, embed_dim)
        self.post_quant_conv = nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)
        self.decoder = Decoder(**ddconfig)

    @classmethod
    def from_files(cls, ckpt: str | Path, yaml_path: str | Path) -> VQGANDecoder:
        import yaml

        ckpt, yaml_path = Path(ckpt), Path(yaml_path)
        for f in (ckpt, yaml_path):
            if not f.is_file():
                raise ValueError(f"VQGAN file not found: {f} (expected vqgan.ckpt and "
                                 "vqgan.yaml as Lumina-mGPT ships them)")
        cfg = yaml.safe_load(yaml_path.read_text())
        try:
            params = cfg["model"]["params"]
            model = cls(params["n_embed"], params["embed_dim"], params["ddconfig"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{yaml_path}: not a VQGAN config (missing {e})") from None
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        wanted = model.state_dict()
        part = {k: v for k, v in state.items() if k in wanted}
        missing = sorted(set(wanted) - set(part))
        if missing:
            raise ValueError(f"{ckpt}: missing {len(missing)} decoder tensors, e.g. {missing[0]}")
        for k, v in part.items():
            if v.shape != wanted[k].shape:
                raise ValueError(f"{ckpt}: {k} has shape {tuple(v.shape)}, the config in "
                                 f"{yaml_path} expects {tuple(wanted[k].shape)}")
        model.load_state_dict(part)
        return model.eval()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))
