"""Tiny random checkpoints of each real-model adapter, written in its release's layout on disk,
so the library can be tried (and is tested) on Janus, Emu3, Lumina-mGPT and LlamaGen without
downloading weights:

    import speculaas as sp
    from speculaas.models.random_checkpoints import write_random_checkpoint

    ckpt = write_random_checkpoint("janus", "tiny-janus")   # a folder, as the release has it
    model = ckpt.load()                                     # sp.load_model("janus", ckpt.path)
    out = sp.generate(model, ckpt.prompts, method="sjd", decode_images=False)

The weights are random (the images are noise), the architectures and files real: the same
transformers classes, safetensors, VQ configurations and token layouts (image start, end of row)
the adapters read from released checkpoints. Text prompts need a tokenizer, which these do not
ship: `prompts` are token-id lists (class ids for LlamaGen).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import load_model
from .base import ImageModel

NAMES = ("janus", "emu3", "lumina-mgpt", "llamagen")

# Janus: token ids of the tiny text vocabulary.
JANUS_BOI, JANUS_PAD, JANUS_BOS = 5, 0, 1
# Emu3 and Lumina-mGPT (Chameleon): text ids below TEXT, then special tokens, then the codebook.
TEXT, CODEBOOK = 100, 64
EMU3_SPECIAL = ["<image>", "<|extra_200|>", "<|image start|>", "<|image end|>", "<|extra_201|>",
                "<eos>", "<pad>", "<bos>"]
EMU3_IDS = {s: TEXT + j for j, s in enumerate(EMU3_SPECIAL)}
LUMINA_SPECIAL = ["<image>", "<racm3:break>", "<eoss>", "<reserved08799>", "<reserved08706>"]
LUMINA_IDS = {s: TEXT + j for j, s in enumerate(LUMINA_SPECIAL)}
LUMINA_PAD, LUMINA_SIZE = 1, (50, 51)  # stand-ins for Lumina-mGPT's size tokens
GRID = (3, 4)  # Emu3 and Lumina-mGPT image grid (rows, columns)
# LlamaGen: a 4 x 4 grid of a 32-code VQ-16 tokenizer.
LLAMAGEN_GRID = 4
LLAMAGEN_VQ = dict(embed_dim=8, num_embeddings=32, latent_channels=32, base_channels=32,
                   channel_multiplier=[1, 2], num_res_blocks=1)


@dataclass
class RandomCheckpoint:
    """What write_random_checkpoint wrote: the adapter's name, the path and options load_model
    takes, and two example prompts in the adapter's format."""

    name: str
    path: str
    options: dict = field(default_factory=dict)
    prompts: list = field(default_factory=list)

    def load(self, **options) -> ImageModel:
        return load_model(self.name, self.path, **{**self.options, **options})


def write_random_checkpoint(name: str, folder: str | Path, seed: int = 0) -> RandomCheckpoint:
    """Write a tiny random checkpoint of adapter `name` (one of NAMES) into `folder` (created).
    Logits are scaled up so greedy decoding is far from ties."""
    if name not in NAMES:
        raise ValueError(f"no random checkpoint for {name!r}; valid: {', '.join(NAMES)}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if name == "llamagen":
        return _llamagen(out, seed)
    return {"janus": _janus, "emu3": _emu3, "lumina-mgpt": _lumina}[name](out)


def _janus(out: Path) -> RandomCheckpoint:
    from transformers import (
        GenerationConfig,
        JanusConfig,
        JanusForConditionalGeneration,
        LlamaConfig,
    )
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

    cfg = JanusConfig(
        text_config=LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512,
                                pad_token_id=JANUS_PAD, bos_token_id=JANUS_BOS, eos_token_id=2),
        vision_config=JanusVisionConfig(hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=24, patch_size=4,
                                        projection_dim=64, depth=1, num_image_tokens=36),
        vq_config=JanusVQVAEConfig(embed_dim=8, num_embeddings=64, latent_channels=32,
                                   base_channels=32, channel_multiplier=[1, 2],
                                   num_res_blocks=1, projection_dim=64,
                                   image_token_embed_dim=64, num_hidden_layers=2),
        image_token_id=3,
    )
    model = JanusForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.generation_head.vision_head.weight.mul_(20)
    model.generation_config = GenerationConfig(
        pad_token_id=JANUS_PAD, bos_token_id=JANUS_BOS, eos_token_id=2,
        generation_kwargs={"boi_token_id": JANUS_BOI})
    model.save_pretrained(out)
    prompts = [[JANUS_BOS, 40, 41, 42, JANUS_BOI], [JANUS_BOS, 77, 78, JANUS_BOI]]
    return RandomCheckpoint("janus", str(out), {}, prompts)


def _emu3(out: Path) -> RandomCheckpoint:
    from transformers import Emu3Config, Emu3ForConditionalGeneration
    from transformers.models.emu3.configuration_emu3 import Emu3TextConfig, Emu3VQVAEConfig

    ids = EMU3_IDS
    vocab = {f"t{i}": i for i in range(TEXT)} | ids
    vocab |= {f"<|visual token {i:06d}|>": TEXT + len(EMU3_SPECIAL) + i for i in range(CODEBOOK)}
    cfg = Emu3Config(
        text_config=Emu3TextConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, pad_token_id=ids["<pad>"],
                                   bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"]),
        vq_config=Emu3VQVAEConfig(codebook_size=CODEBOOK, embed_dim=4, latent_channels=4,
                                  base_channels=32, channel_multiplier=[1, 2], num_res_blocks=1,
                                  attn_resolutions=[], hidden_size=64, num_attention_heads=1,
                                  temporal_downsample_factor=4),
        vocabulary_map=vocab,
    )
    model = Emu3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(out)
    bos, boi, img = ids["<bos>"], ids["<|image start|>"], ids["<image>"]
    prompts = [[bos, 5, 6, 7, boi, 20, 21, 22, img], [bos, 9, boi, 20, 21, 22, img]]
    return RandomCheckpoint("emu3", str(out), {"grid": GRID}, prompts)


def lumina_image_token(i: int) -> str:
    """Chameleon's name of codebook entry i ("IMGIMG" + its digits as letters + "Z")."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"


def _lumina(out: Path) -> RandomCheckpoint:
    import yaml
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration
    from transformers.models.chameleon.configuration_chameleon import ChameleonVQVAEConfig

    from .vqgan import VQGANDecoder

    ids = LUMINA_IDS
    vocab = {f"t{i}": i for i in range(TEXT)} | ids
    vocab |= {lumina_image_token(i): TEXT + len(LUMINA_SPECIAL) + i for i in range(CODEBOOK)}
    cfg = ChameleonConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocabulary_map=vocab,
        pad_token_id=LUMINA_PAD,
        vq_config=ChameleonVQVAEConfig(embed_dim=8, num_embeddings=CODEBOOK, latent_channels=32,
                                       base_channels=32, channel_multiplier=[1, 2],
                                       num_res_blocks=1, resolution=16, attn_resolutions=[]))
    model = ChameleonForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(out)
    ddconfig = {"double_z": False, "z_channels": 8, "resolution": 16, "in_channels": 3,
                "out_ch": 3, "ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1,
                "attn_resolutions": [], "dropout": 0.0}
    vq = VQGANDecoder(CODEBOOK, 8, ddconfig)
    (out / "vqgan").mkdir(exist_ok=True)
    torch.save({"state_dict": dict(vq.state_dict())}, out / "vqgan" / "vqgan.ckpt")
    (out / "vqgan" / "vqgan.yaml").write_text(yaml.safe_dump(
        {"model": {"params": {"n_embed": CODEBOOK, "embed_dim": 8, "ddconfig": ddconfig}}}))
    sys_end, boi = ids["<reserved08706>"], ids["<racm3:break>"]
    prompts = [[0, 5, 6, 7, sys_end, boi, *LUMINA_SIZE], [0, 9, sys_end, boi, *LUMINA_SIZE]]
    return RandomCheckpoint("lumina-mgpt", str(out), {"grid": GRID}, prompts)


def llamagen_gpt(model_type: str, seed: int = 0):  # noqa: ANN201
    """A tiny random LlamaGen GPT ("c2i" or "t2i") of the release's architecture."""
    from .llamagen import LlamaGenGPT

    torch.manual_seed(seed)
    gpt = LlamaGenGPT(dim=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=32, ffn_hidden=96,
                      grid=LLAMAGEN_GRID, model_type=model_type, num_classes=10,
                      caption_dim=24, cls_token_num=1 if model_type == "c2i" else 6)
    with torch.no_grad():
        gpt.output.weight.normal_(std=2.0)
        if model_type == "t2i":
            gpt.cls_embedding.uncond_embedding.normal_()
    return gpt


def janus_to_llamagen(name: str) -> str:
    """A JanusVQVAE weight name as LlamaGen's VQ-16 checkpoint spells it."""
    name = re.sub(r"^(encoder)\.down\.(\d+)\.block\.", r"\1.conv_blocks.\2.res.", name)
    name = re.sub(r"^(encoder)\.down\.(\d+)\.", r"\1.conv_blocks.\2.", name)
    name = re.sub(r"^(decoder)\.up\.(\d+)\.block\.", r"\1.conv_blocks.\2.res.", name)
    name = re.sub(r"^(decoder)\.up\.(\d+)\.", r"\1.conv_blocks.\2.", name)
    for i, part in enumerate(("block_1", "attn_1", "block_2")):
        name = name.replace(f".mid.{part}.", f".mid.{i}.")
    return name


def llamagen_vq(seed: int = 1):  # noqa: ANN201
    """A tiny random VQ-16 tokenizer (as transformers' JanusVQVAE, which shares its layout)."""
    from transformers.models.janus.configuration_janus import JanusVQVAEConfig
    from transformers.models.janus.modeling_janus import JanusVQVAE

    torch.manual_seed(seed)
    return JanusVQVAE(JanusVQVAEConfig(**LLAMAGEN_VQ, num_patches=LLAMAGEN_GRID,
                                       projection_dim=8, image_token_embed_dim=8))


def _llamagen(out: Path, seed: int) -> RandomCheckpoint:
    from .llamagen import make_checkpoint

    make_checkpoint(llamagen_gpt("c2i", seed), out / "c2i_tiny_64.pt")
    vq = llamagen_vq(seed + 1)
    torch.save({"model": {janus_to_llamagen(k): v for k, v in vq.state_dict().items()}},
               out / "vq_tiny.pt")
    options = {"vq": str(out / "vq_tiny.pt"), "image_size": LLAMAGEN_GRID * 16,
               "vq_config": LLAMAGEN_VQ, "n_head": 4}
    return RandomCheckpoint("llamagen", str(out / "c2i_tiny_64.pt"), options, [3, 7])
