"""Lumina-mGPT / Chameleon adapter on a tiny random `ChameleonForConditionalGeneration` and a
tiny VQGAN decoder saved as vqgan.ckpt + vqgan.yaml."""

import pytest
import torch
import yaml
from conftest import assert_same_as_ar

import speculaas as sp
from speculaas.models.vqgan import VQGANDecoder

CODEBOOK, TEXT, H, W = 64, 100, 3, 4
SPECIAL = ["<image>", "<racm3:break>", "<eoss>", "<reserved08799>", "<reserved08706>"]
IDS = {s: TEXT + j for j, s in enumerate(SPECIAL)}
BOI, EOL, PAD = IDS["<racm3:break>"], IDS["<reserved08799>"], 1
SIZE_H, SIZE_W = 50, 51  # stand-ins for Lumina-mGPT's size tokens


def _img_name(i: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration
    from transformers.models.chameleon.configuration_chameleon import ChameleonVQVAEConfig

    vocab = {f"t{i}": i for i in range(TEXT)} | IDS
    vocab |= {_img_name(i): TEXT + len(SPECIAL) + i for i in range(CODEBOOK)}
    torch.manual_seed(0)
    cfg = ChameleonConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocabulary_map=vocab, pad_token_id=PAD,
        vq_config=ChameleonVQVAEConfig(embed_dim=8, num_embeddings=CODEBOOK, latent_channels=32,
                                       base_channels=32, channel_multiplier=[1, 2],
                                       num_res_blocks=1, resolution=16, attn_resolutions=[]))
    model = ChameleonForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    out = tmp_path_factory.mktemp("lumina")
    model.save_pretrained(out)
    ddconfig = {"double_z": False, "z_channels": 8, "resolution": 16, "in_channels": 3,
                "out_ch": 3, "ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1,
                "attn_resolutions": [], "dropout": 0.0}
    vq = VQGANDecoder(CODEBOOK, 8, ddconfig)
    (out / "vqgan").mkdir()
    torch.save({"state_dict": {f"{k}": v for k, v in vq.state_dict().items()}},
               out / "vqgan" / "vqgan.ckpt")
    (out / "vqgan" / "vqgan.yaml").write_text(yaml.safe_dump(
        {"model": {"params": {"n_embed": CODEBOOK, "embed_dim": 8, "ddconfig": ddconfig}}}))
    return out


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
