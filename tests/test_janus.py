"""Janus adapter on a tiny random `JanusForConditionalGeneration` saved and loaded from disk."""

from pathlib import Path

import pytest
import torch
from conftest import assert_same_as_ar

import speculaas as sp
from speculaas.models.random_checkpoints import JANUS_BOI as BOI
from speculaas.models.random_checkpoints import JANUS_BOS as BOS
from speculaas.models.random_checkpoints import JANUS_PAD as PAD
from speculaas.models.random_checkpoints import write_random_checkpoint


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    return Path(write_random_checkpoint("janus", tmp_path_factory.mktemp("janus")).path)


@pytest.fixture(scope="module")
def janus(janus_dir):
    return sp.load_model("janus", str(janus_dir))


PROMPTS = [[BOS, 40, 41, 42, BOI], [BOS, 77, 78, BOI]]


@pytest.mark.parametrize("window", [1, 4, 16])
@pytest.mark.parametrize("method", ["sjd", "csd"])
def test_greedy_speculative_equals_greedy_ar_with_cfg(janus, window, method):
    ar = sp.generate(janus, PROMPTS, method="ar", top_k=1, decode_images=False)
    out = sp.generate(
        janus, PROMPTS, method=method, top_k=1, window=window, seed=3, decode_images=False
    )
    assert torch.equal(out.tokens, ar.tokens)


def test_sjd_draws_the_tokens_ar_draws(janus):
    """Sample-exact: CFG 5 (the model's default), sampled, every window and the policy."""
    assert_same_as_ar(janus, PROMPTS, windows=(1, 16, 64, "auto"), seed=3)
    assert_same_as_ar(janus, PROMPTS, windows=(4,), seed=4, top_k=20, method="csd", lam=0.0)


def test_ar_matches_transformers_image_generation(janus):
    from transformers import GenerationConfig

    ours = sp.generate(janus, [PROMPTS[0]], method="ar", top_k=1, decode_images=False)
    prompt = torch.tensor([PROMPTS[0]])
    gc = GenerationConfig(
        max_new_tokens=36,
        do_sample=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=2,
        guidance_scale=5.0,
        generation_kwargs={"boi_token_id": BOI},
    )
    theirs = janus.hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        generation_config=gc,
        generation_mode="image",
    )
    assert torch.equal(ours.tokens, theirs.cpu())


def test_decode_and_cache_rollback(janus):
    out = sp.generate(janus, PROMPTS, method="csd", seed=0)
    assert out.tokens.shape == (2, 36) and out.images[0].size[0] == out.images[0].size[1]
    from conftest import check_rollback

    check_rollback(janus, PROMPTS[0], out.tokens[0], janus.vocab_size, split=11)


def test_wrong_family_and_missing_files(tmp_path, janus_dir):
    with pytest.raises(ValueError, match="config.json not found"):
        sp.load_model("janus", str(tmp_path))
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a 'llama' model, expected 'janus'"):
        sp.load_model("janus", str(tmp_path))
    with pytest.raises(ValueError, match="janus needs a checkpoint"):
        sp.load_model("janus")


def test_model_already_in_memory(janus, janus_dir):
    """A researcher's loaded model and processor wrap without a second load from disk."""
    from transformers import JanusForConditionalGeneration

    loaded = JanusForConditionalGeneration.from_pretrained(janus_dir)
    wrapped = sp.load_model("janus", model=loaded)
    # A fixed window: "auto" measures each model object's cost curve on its own.
    a = sp.generate(wrapped, PROMPTS, method="csd", seed=2, window=16, decode_images=False)
    b = sp.generate(janus, PROMPTS, method="csd", seed=2, window=16, decode_images=False)
    assert torch.equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match="not both"):
        sp.load_model("janus", str(janus_dir), model=loaded)
    with pytest.raises(ValueError, match="must be a transformers JanusForConditionalGeneration"):
        sp.load_model("janus", model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a checkpoint"):
        sp.load_model("janus")


def test_remote_code_is_never_run(janus_dir, tmp_path):
    """A checkpoint whose config asks for its own code (auto_map) loads with the library's
    classes; nothing asks whether to run the folder's code."""
    import json
    import shutil

    folder = tmp_path / "with-auto-map"
    shutil.copytree(janus_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    model = sp.load_model("janus", str(folder))
    assert type(model.hf).__module__.startswith("transformers.")


@pytest.mark.parametrize("name", ["janus", "emu3", "lumina-mgpt", "llamagen"])
def test_every_random_checkpoint_loads_and_decodes_exactly(name, tmp_path):
    ckpt = write_random_checkpoint(name, tmp_path / name)
    model = ckpt.load()
    assert_same_as_ar(model, ckpt.prompts, windows=(4,), seed=2)


def test_an_unknown_random_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no random checkpoint for 'dalle'"):
        write_random_checkpoint("dalle", tmp_path)
