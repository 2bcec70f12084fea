"""LlamaGen: our GPT saved in the released .pt layout and loaded through the real loading code
(weights_only=True), c2i and t2i, plus the VQ-16 weight-name mapping onto JanusVQVAE."""


import numpy as np
import pytest
import torch
from conftest import assert_same_as_ar

import speculaas as sp
from speculaas.models.llamagen import make_checkpoint
from speculaas.models.random_checkpoints import (
    LLAMAGEN_GRID,
    LLAMAGEN_VQ,
    llamagen_gpt,
    llamagen_vq,
    write_random_checkpoint,
)

GRID, VQ_CFG = LLAMAGEN_GRID, LLAMAGEN_VQ


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("llamagen")
    write_random_checkpoint("llamagen", out)  # c2i_tiny_64.pt and vq_tiny.pt
    make_checkpoint(llamagen_gpt("t2i"), out / "t2i_tiny_64.pt")
    return out, llamagen_vq()  # the tokenizer it wrote, as transformers' JanusVQVAE


@pytest.fixture(scope="module")
def c2i(files):
    out, _ = files
    return sp.load_model("llamagen", str(out / "c2i_tiny_64.pt"), vq=str(out / "vq_tiny.pt"),
                         image_size=GRID * 16, vq_config=VQ_CFG, n_head=4)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_c2i_greedy_speculative_equals_ar_with_cfg(c2i, window):
    ar = sp.generate(c2i, [3, 7, None], method="ar", top_k=1, decode_images=False)
    for method in ("sjd", "csd"):
        out = sp.generate(c2i, [3, 7, None], method=method, top_k=1, window=window, seed=5,
                          decode_images=False)
        assert torch.equal(out.tokens, ar.tokens), method


def test_c2i_sjd_draws_the_tokens_ar_draws(c2i):
    assert_same_as_ar(c2i, [3, 7, None], windows=(1, 2, 16, 64, "auto"), seed=5, cfg_scale=4.0,
                      top_k=50)


def test_c2i_matches_a_full_causal_pass(c2i):
    """Cached, rolled-back decoding scores like LlamaGen's own full forward over the sequence."""
    out = sp.generate(c2i, [3], method="csd", seed=0, cfg_scale=1.0, decode_images=False)
    gpt = c2i.gpt
    x = torch.cat([gpt.cls_embedding.embedding_table(torch.tensor([[3]])),
                   gpt.tok_embeddings(out.tokens[:, :-1])], 1)
    cache = gpt.new_cache(1)
    full = gpt.forward_cached(x, torch.arange(x.shape[1])[None], cache, torch.tensor([0]))
    session = c2i.start([3], cfg=False)
    prev = torch.cat([torch.zeros(1, 1, dtype=torch.long), out.tokens[:, :-1]], 1)
    session.forward(torch.randint(32, (1, 6)), torch.tensor([0]), torch.tensor([0]))  # junk
    a, _ = session.forward(prev[:, :9], torch.tensor([0]), torch.tensor([0]))
    session.forward(torch.randint(32, (1, 5)), torch.tensor([8]), torch.tensor([0]))  # junk
    b, _ = session.forward(prev[:, 8:], torch.tensor([8]), torch.tensor([0]))
    assert torch.allclose(torch.cat([a[:, :8], b], 1), full, atol=1e-4)


def test_vq16_names_map_onto_janus_vqvae(files, c2i):
    _, vq = files
    tokens = torch.randint(32, (2, GRID * GRID))
    out = c2i.decode(tokens)
    with torch.no_grad():
        ref = vq.decode(tokens)
    assert out[0].size == (ref.shape[-1], ref.shape[-2])
    got = torch.from_numpy(np.array(out[0])).float()
    want = ((ref[0].clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0)
    assert (got - want).abs().max() <= 1


def other_emb(cap):
    """The same caption with different values at its padded positions."""
    emb = cap["embedding"].clone()
    emb[~cap["mask"]] = 100.0
    return emb


def test_t2i_with_caption_embeddings_and_padding_mask(files):
    out, _ = files
    model = sp.load_model("llamagen", str(out / "t2i_tiny_64.pt"), image_size=GRID * 16,
                          n_head=4)
    torch.manual_seed(3)
    caps = [torch.randn(6, 24), {"embedding": torch.randn(6, 24),
                                 "mask": torch.tensor([False, False, True, True, True, True])}]
    ar = sp.generate(model, caps, method="ar", top_k=1, decode_images=False)
    sjd = sp.generate(model, caps, method="sjd", top_k=1, window=5, decode_images=False)
    assert torch.equal(ar.tokens, sjd.tokens)
    rows = sp.generate(model, caps, method="sjd", top_k=1, row_context=GRID, decode_images=False)
    assert torch.equal(ar.tokens, rows.tokens)  # the packed mask keeps the padding hidden too
    padded = {"embedding": other_emb(caps[1]), "mask": caps[1]["mask"]}
    assert torch.equal(sp.generate(model, [caps[0], padded], method="csd", row_context=2,
                                   seed=4, decode_images=False).tokens,
                       sp.generate(model, caps, method="csd", row_context=2, seed=4,
                                   decode_images=False).tokens)
    # padded positions are really ignored: changing them changes nothing
    other = {"embedding": caps[1]["embedding"].clone(), "mask": caps[1]["mask"]}
    other["embedding"][:2] = 100.0
    again = sp.generate(model, [caps[0], other], method="ar", top_k=1, decode_images=False)
    assert torch.equal(again.tokens, ar.tokens)
    with pytest.raises(ValueError, match="caption embeddings of shape"):
        sp.generate(model, [torch.randn(3, 24)], method="ar")


def test_bad_checkpoints(tmp_path, files):
    with pytest.raises(ValueError, match="checkpoint not found"):
        sp.load_model("llamagen", str(tmp_path / "missing.pt"))
    torch.save({"model": {"foo": torch.zeros(1)}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a LlamaGen GPT checkpoint"):
        sp.load_model("llamagen", str(tmp_path / "bad.pt"))
    out, _ = files
    with pytest.raises(ValueError, match="has shape"):
        sp.load_model("llamagen", str(out / "c2i_tiny_64.pt"), vq=str(out / "vq_tiny.pt"),
                      image_size=GRID * 16, n_head=4,
                      vq_config={**VQ_CFG, "base_channels": 64})


def test_t2i_encodes_text_with_a_local_t5(files, tmp_path):
    """Captions go through a (tiny, random) T5 encoder and come out left-padded with their
    mask, exactly as if the embeddings had been passed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    out, _ = files
    words = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", "a", "red", "fox", "cat"])}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                        pad_token="<pad>", eos_token="</s>")
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=len(words), d_model=24, d_kv=8, d_ff=32,
                                 num_layers=1, num_heads=3)).eval()
    t5.save_pretrained(tmp_path / "t5")
    tokenizer.save_pretrained(tmp_path / "t5")
    model = sp.load_model("llamagen", str(out / "t2i_tiny_64.pt"), image_size=GRID * 16,
                          n_head=4, t5=str(tmp_path / "t5"))
    enc = model.encode_captions(["a red fox"])[0]
    assert enc["mask"].tolist() == [False, False, False, True, True, True]
    hidden = t5(input_ids=torch.tensor([[3, 4, 5]])).last_hidden_state[0]
    assert torch.allclose(enc["embedding"][3:], hidden, atol=1e-5)
    assert (enc["embedding"][:3] == 0).all()
    text = sp.generate(model, ["a red fox"], method="ar", top_k=1, decode_images=False)
    emb = sp.generate(model, [enc], method="ar", top_k=1, decode_images=False)
    assert torch.equal(text.tokens, emb.tokens)
    plain = sp.load_model("llamagen", str(out / "t2i_tiny_64.pt"), image_size=GRID * 16,
                          n_head=4)
    with pytest.raises(ValueError, match="takes text only with a T5 encoder"):
        sp.generate(plain, ["a red fox"], method="ar")


def test_c2i_two_dimensional_window(c2i):
    """row_context on LlamaGen (2-D rotary, grouped heads, CFG): a full row of context is raster
    Jacobi decoding with the same seed; greedy equals AR; c = 1 runs rows side by side."""
    kw = dict(method="csd", seed=[3, 4, 5], decode_images=False, window=16)
    raster = sp.generate(c2i, [3, 7, None], **kw)
    full = sp.generate(c2i, [3, 7, None], row_context=GRID, **kw)
    assert torch.equal(full.tokens, raster.tokens)
    ar = sp.generate(c2i, [3, 7, None], method="ar", top_k=1, decode_images=False)
    greedy = sp.generate(c2i, [3, 7, None], method="sjd", top_k=1, row_context=GRID, seed=1,
                         decode_images=False)
    assert torch.equal(greedy.tokens, ar.tokens)
    diag = sp.generate(c2i, [3, 7, None], row_context=1, **kw)
    assert (diag.commit_step[:, 1:, 0] < diag.commit_step[:, :-1, -1]).any()
    assert (diag.commit_step >= 0).all()


def test_t2i_unconditional_rows_see_the_caption_padding_mask(files):
    """LlamaGen masks the null rows with the caption's padding mask: the unconditional logits
    ignore uncond_embedding at the caption's padded positions and follow it elsewhere."""
    out, _ = files
    model = sp.load_model("llamagen", str(out / "t2i_tiny_64.pt"), image_size=GRID * 16,
                          n_head=4)
    torch.manual_seed(5)
    cap = {"embedding": torch.randn(6, 24),
           "mask": torch.tensor([False, False, False, True, True, True])}
    table = model.gpt.cls_embedding.uncond_embedding

    def uncond_logits():  # noqa: ANN202
        session = model.start([cap], cfg=True)
        _, uncond = session.forward(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]),
                                    torch.tensor([0]))
        return uncond[0, 0]

    base = uncond_logits()
    saved = table.detach().clone()
    with torch.no_grad():
        try:
            table[:3] += 5.0  # padded positions of the caption
            assert torch.allclose(uncond_logits(), base, atol=1e-5)
            table[3] += 5.0  # a position the caption uses
            assert not torch.allclose(uncond_logits(), base, atol=1e-3)
        finally:
            table.copy_(saved)
    ar = sp.generate(model, [cap, None], method="ar", top_k=1, cfg_scale=4.0,
                     decode_images=False)
    sjd = sp.generate(model, [cap, None], method="sjd", top_k=1, cfg_scale=4.0, window=6,
                      decode_images=False)
    assert torch.equal(ar.tokens, sjd.tokens)
    with pytest.raises(ValueError, match="caption mask"):
        sp.generate(model, [{"embedding": cap["embedding"], "mask": torch.ones(4, dtype=bool)}],
                    method="ar")


def test_c2i_candidate_trees(c2i):
    """Trees on LlamaGen (2-D rotary, grouped heads, CFG): a branch never sees its sibling, and
    sjd with a tree draws AR's tokens."""
    from test_tree import assert_branches_independent
    assert_branches_independent(c2i)
    assert_same_as_ar(c2i, [3, 7, None], windows=(16, 32), seed=5, cfg_scale=4.0, tree=(3, 3))
