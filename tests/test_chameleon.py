"""Lumina-mGPT / Chameleon adapter on a tiny random `ChameleonForConditionalGeneration` and a
tiny VQGAN decoder saved as vqgan.ckpt + vqgan.yaml."""

import re
from pathlib import Path

import pytest
import torch
from conftest import assert_same_as_ar

import speculaas as sp
from speculaas.models.random_checkpoints import (
    CODEBOOK,
    GRID,
    LUMINA_IDS,
    LUMINA_PAD,
    LUMINA_SIZE,
    write_random_checkpoint,
)

(H, W), IDS = GRID, LUMINA_IDS
BOI, EOL, PAD = IDS["<racm3:break>"], IDS["<reserved08799>"], LUMINA_PAD
SIZE_H, SIZE_W = LUMINA_SIZE  # stand-ins for Lumina-mGPT's size tokens


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    return Path(write_random_checkpoint("lumina-mgpt", tmp_path_factory.mktemp("lumina")).path)


@pytest.fixture(scope="module")
def lumina(lumina_dir):
    return sp.load_model("lumina-mgpt", str(lumina_dir), grid=(H, W))


PROMPTS = [[0, 5, 6, 7, IDS["<reserved08706>"], BOI, SIZE_H, SIZE_W],
           [0, 9, IDS["<reserved08706>"], BOI, SIZE_H, SIZE_W]]


@pytest.mark.parametrize("window", [1, 4, 16])
def test_greedy_speculative_equals_greedy_ar_with_cfg(lumina, window):
    ar = sp.generate(lumina, PROMPTS, method="ar", top_k=1, decode_images=False)
    for method in ("sjd", "csd", "gsd", "lantern"):
        out = sp.generate(lumina, PROMPTS, method=method, top_k=1, window=window, seed=2,
                          decode_images=False)
        assert torch.equal(out.sequence, ar.sequence), method


def test_sjd_draws_the_tokens_ar_draws(lumina):
    """Sample-exact with the model's defaults (CFG 3, top-k 2000)."""
    assert_same_as_ar(lumina, PROMPTS, windows=(1, 6, 16, 64, "auto"), seed=2)


def test_forced_end_of_line_and_pixels(lumina):
    out = sp.generate(lumina, PROMPTS, method="csd", seed=0, window=6)
    bpe = lumina.index_to_bpe[out.sequence]
    assert (bpe[:, W :: W + 1] == EOL).all() and (out.tokens < CODEBOOK).all()
    assert out.images[0].size == (2 * W, 2 * H)  # one upsampling level in the tiny VQGAN


def test_cache_rollback_matches_fresh_pass(lumina):
    from conftest import check_rollback

    out = sp.generate(lumina, [PROMPTS[1]], method="csd", seed=2, decode_images=False)
    check_rollback(lumina, PROMPTS[1], out.sequence[0], lumina.vocab_size)


def test_unconditional_context_starts_at_image_start(lumina):
    """The padded, masked unconditional row scores like a context of [BOI, H, W] alone."""
    session = lumina.start([PROMPTS[0]], cfg=True)
    window = torch.tensor([[0, 3, 9, 4]])
    _, uncond = session.forward(window, torch.tensor([0]), torch.tensor([0]))
    alone = lumina.start([[BOI, SIZE_H, SIZE_W]], cfg=False)
    cond_alone, _ = alone.forward(window, torch.tensor([0]), torch.tensor([0]))
    assert torch.allclose(uncond, cond_alone, atol=1e-4)


def test_missing_vqgan_and_bad_prompts(lumina_dir, tmp_path):
    with pytest.raises(ValueError, match="VQGAN file not found"):
        sp.load_model("lumina-mgpt", str(lumina_dir), grid=(H, W), vqgan=str(tmp_path))
    model = sp.load_model("lumina-mgpt", str(lumina_dir), grid=(H, W), vqgan=None)
    with pytest.raises(ValueError, match="image-start token"):
        sp.generate(model, [[0, 5, 6]], method="csd")
    with pytest.raises(ValueError, match="token ids"):
        sp.generate(model, ["a cat"], method="csd")


def test_text_prompt_follows_lumina_generation_format(lumina_dir):
    """A caption becomes <bos> template <end-of-turn> <image-start> <H> <W> (the size tokens
    named <reserved0{8800 + pixels/32}>), through a tokenizer given in memory."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(["t0", "Generate", "an", "image", "of", "64x48",
                                          "according", "to", "the", "following", "prompt:",
                                          "a", "red", "fox"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    hf = ChameleonForConditionalGeneration.from_pretrained(lumina_dir)
    vocab = dict(hf.config.vocabulary_map)
    size_h, size_w = f"<reserved{8800 + H // 2:05d}>", f"<reserved{8800 + W // 2:05d}>"
    with pytest.raises(ValueError, match="no tokenizer"):
        sp.load_model("lumina-mgpt", model=hf, grid=(H, W)).check_prompts(["a red fox"])
    with pytest.raises(ValueError, match="has no"):
        sp.load_model("lumina-mgpt", model=hf, grid=(H, W), processor=tokenizer) \
            .check_prompts(["a red fox"])
    vocab |= {size_h: 60, size_w: 61}
    hf.config.vocabulary_map = vocab
    hf.model.vocabulary_mapping.vocab_map.update({size_h: 60, size_w: 61})
    model = sp.load_model("lumina-mgpt", model=hf, grid=(H, W), processor=tokenizer)
    ids = model.text_prompt("a red fox")
    body = [words[w] for w in "Generate an image of 64x48 according to the following prompt: "
            "a red fox".split()]
    assert ids == [hf.config.bos_token_id] + body + [IDS["<reserved08706>"], BOI, 60, 61]
    out = sp.generate(model, ["a red fox"], method="csd", top_k=1, decode_images=False)
    ar = sp.generate(model, ["a red fox"], method="ar", top_k=1, decode_images=False)
    assert torch.equal(out.tokens, ar.tokens) and json.dumps(ids)


def _official_layout(src, dst, mp=2):
    """The tiny checkpoint rewritten as Lumina-mGPT's official class stores it: q/k layer norms
    as one row per model-parallel shard, shared by the shard's heads; and the same weights in
    transformers' layout (each shard's row repeated over its heads) for comparison."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    ours = {}
    for name, t in tensors.items():
        if re.search(r"\.(q|k)_norm\.(weight|bias)$", name):
            rows = 1 + 0.5 * torch.randn(mp, t.shape[1], generator=g)  # distinct per shard
            tensors[name] = rows
            ours[name] = rows.repeat_interleave(t.shape[0] // mp, dim=0)
    for folder, stored in ((dst / "official", tensors), (dst / "transformers", ours)):
        shutil.copytree(src, folder)
        save_file({**tensors, **stored} if stored is ours else stored,
                  folder / "model.safetensors")
    config = json.loads((dst / "official" / "config.json").read_text())
    config["model_parallel_size"] = mp
    (dst / "official" / "config.json").write_text(json.dumps(config))
    return dst / "official", dst / "transformers"


def test_official_checkpoints_with_per_shard_norms_load(lumina_dir, tmp_path):
    official, ours = _official_layout(lumina_dir, tmp_path)
    a = sp.load_model("lumina-mgpt", str(official), grid=(H, W))
    b = sp.load_model("lumina-mgpt", str(ours), grid=(H, W))
    la = a.hf(torch.tensor([PROMPTS[0]])).logits
    assert torch.allclose(la, b.hf(torch.tensor([PROMPTS[0]])).logits)
    assert not torch.allclose(la, lumina_model_logits(lumina_dir))  # the norms mattered
    assert_same_as_ar(a, PROMPTS, windows=(4,), seed=1)


def lumina_model_logits(folder):
    return sp.load_model("lumina-mgpt", str(folder), grid=(H, W)).hf(
        torch.tensor([PROMPTS[0]])).logits


def test_a_checkpoint_that_fits_neither_layout_names_the_tensor(lumina_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(lumina_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(3, 16)  # 3 rows for 4 heads
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_norm.weight has shape "
                                         r"\(3, 16\) in the checkpoint, the model expects "
                                         r"\(4, 16\)"):
        sp.load_model("lumina-mgpt", str(bad), grid=(H, W))
