"""Emu3 adapter on a tiny random `Emu3ForConditionalGeneration`: forced end-of-line layout,
batched CFG, greedy equivalence with AR and with transformers' own constrained generation."""

from pathlib import Path

import pytest
import torch
from conftest import assert_same_as_ar

import speculaas as sp
from speculaas.models.emu3 import NEGATIVE_PROMPT
from speculaas.models.random_checkpoints import (
    CODEBOOK,
    EMU3_IDS,
    GRID,
    write_random_checkpoint,
)

(H, W), IDS = GRID, EMU3_IDS
EOL, BOI, PAD, BOS = IDS["<|extra_200|>"], IDS["<|image start|>"], IDS["<pad>"], IDS["<bos>"]


@pytest.fixture(scope="module")
def emu3_dir(tmp_path_factory):
    return Path(write_random_checkpoint("emu3", tmp_path_factory.mktemp("emu3")).path)


@pytest.fixture(scope="module")
def emu3(emu3_dir):
    return sp.load_model("emu3", str(emu3_dir), grid=(H, W))


PROMPTS = [
    [BOS, 5, 6, 7, BOI, 20, 21, 22, IDS["<image>"]],
    [BOS, 9, BOI, 20, 21, 22, IDS["<image>"]],
]


@pytest.mark.parametrize("window", [1, 4, 16])
def test_greedy_speculative_equals_greedy_ar(emu3, window):
    ar = sp.generate(emu3, PROMPTS, method="ar", top_k=1, decode_images=False)
    for method in ("sjd", "csd"):
        out = sp.generate(
            emu3, PROMPTS, method=method, top_k=1, window=window, seed=1, decode_images=False
        )
        assert torch.equal(out.sequence, ar.sequence), method


def test_sjd_draws_the_tokens_ar_draws(emu3):
    """Sample-exact, forced end-of-line tokens included."""
    assert_same_as_ar(emu3, PROMPTS, windows=(1, 4, 16, 64, "auto"), seed=1, cfg_scale=3.0)


def test_end_of_line_is_forced_where_the_layout_says(emu3):
    out = sp.generate(emu3, PROMPTS, method="csd", seed=4, window=8)
    bpe = emu3.index_to_bpe[out.sequence]
    assert (bpe[:, W :: W + 1] == EOL).all()
    free = torch.ones(H * (W + 1), dtype=torch.bool)
    free[W :: W + 1] = False
    assert (bpe[:, free] != EOL).all()
    assert out.tokens.shape == (2, H * W) and (out.tokens < CODEBOOK).all()
    assert [im.size for im in out.images] == [(2 * W, 2 * H)] * 2  # one upsampling level


def test_cache_rollback_matches_fresh_pass(emu3):
    from conftest import check_rollback

    out = sp.generate(emu3, [PROMPTS[0]], method="csd", seed=2, decode_images=False)
    check_rollback(emu3, PROMPTS[0], out.sequence[0], emu3.vocab_size)


def test_ar_matches_transformers_constrained_generation(emu3):
    prompt = torch.tensor([PROMPTS[0]])
    visual = emu3.index_to_bpe[:CODEBOOK].tolist()

    def allowed(batch_id, input_ids):
        off = input_ids.shape[0] - prompt.shape[1]
        return [EOL] if off % (W + 1) == W else visual

    ours = sp.generate(emu3, [PROMPTS[0]], method="ar", top_k=1, cfg_scale=3.0, decode_images=False)
    theirs = emu3.hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=H * (W + 1),
        do_sample=False,
        prefix_allowed_tokens_fn=allowed,
        guidance_scale=3.0,
        negative_prompt_ids=emu3.unconditional(prompt[0])[None],
        negative_prompt_attention_mask=torch.ones_like(prompt),
        pad_token_id=PAD,
        eos_token_id=IDS["<eos>"],
    )
    assert torch.equal(emu3.index_to_bpe[ours.sequence[0]], theirs[0, prompt.shape[1] :])


NEGATIVE = [BOS, 11, 12, 13, 14, 15, 16, BOI, 20, 21, 22, IDS["<image>"]]  # longer than both


@pytest.mark.parametrize("negative", [NEGATIVE, NEGATIVE[:1] + NEGATIVE[-5:]])
def test_negative_prompt_guides_as_transformers_does(emu3_dir, negative):
    """The unconditional row is the negative prompt, fully attended, whatever its length:
    greedy AR equals transformers' own unbatched CFG over the same negative ids."""
    model = sp.load_model("emu3", str(emu3_dir), grid=(H, W), negative_prompt=negative)
    assert torch.equal(model.unconditional(torch.tensor(PROMPTS[1])), torch.tensor(negative))
    visual = model.index_to_bpe[:CODEBOOK].tolist()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])

        def allowed(batch_id, input_ids, n=ids.shape[1]):
            return [EOL] if (input_ids.shape[0] - n) % (W + 1) == W else visual

        ours = sp.generate(model, [prompt], method="ar", top_k=1, cfg_scale=3.0,
                           decode_images=False)
        theirs = model.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=H * (W + 1),
            do_sample=False, prefix_allowed_tokens_fn=allowed, guidance_scale=3.0,
            negative_prompt_ids=torch.tensor([negative]),
            negative_prompt_attention_mask=torch.ones(1, len(negative), dtype=torch.long),
            pad_token_id=PAD, eos_token_id=IDS["<eos>"])
        assert torch.equal(model.index_to_bpe[ours.sequence[0]], theirs[0, ids.shape[1]:])
    assert_same_as_ar(model, PROMPTS, windows=(4, 16, "auto"), seed=1, cfg_scale=3.0)


def test_text_prompts_follow_the_recipe_and_state_their_grid(emu3_dir):
    from transformers.models.emu3.processing_emu3 import Emu3Processor

    seen = {}

    class Recording:  # stands in for the checkpoint's processor: records what it is asked
        def __call__(self, **kwargs):
            seen.update(kwargs)
            from types import SimpleNamespace
            return SimpleNamespace(input_ids=torch.tensor([[BOS, 5, BOI, 20, IDS["<image>"]]]))

    model = sp.load_model("emu3", str(emu3_dir), grid=(4, 6), processor=Recording())
    model.check_prompts(["a red cat"])
    size = Emu3Processor.calculate_generate_size(None, seen["ratio"], seen["image_area"], 8)
    assert size == (4, 6)  # rows x cols in the size header, not a square of the same area
    assert seen["text"] == ["a red cat masterpiece, film grained, best quality."]  # the recipe's
    plain = sp.load_model("emu3", str(emu3_dir), processor=Recording(), quality_suffix="")
    plain.check_prompts(["a red cat"])
    assert seen["text"] == ["a red cat"]
    model.unconditional(torch.tensor([BOS, 5, BOI, 20, IDS["<image>"]]))
    assert seen["text"] == [NEGATIVE_PROMPT]  # the recipe's negative prompt, no suffix
    assert seen["ratio"] == "6:4"
