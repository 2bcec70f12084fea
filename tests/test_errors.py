"""Bad input gets a clear ValueError naming the problem."""

import copy

import numpy as np
import pytest
import torch

import speculaas as sp
from speculaas.config import SamplingConfig


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"method": "csd", "lam": -0.1}, "lam must be a finite number >= 0"),
    ({"method": "csd", "lam": float("inf")}, "lam must be a finite number >= 0"),
    ({"method": "csd", "lam": True}, "lam must be a finite number >= 0"),
    ({"method": "csd", "lam": "0.5"}, "lam must be a finite number >= 0"),
    ({"method": "csd", "delta": 1.5}, r"delta must be in \[0, 1\]"),
    ({"method": "csd", "delta": float("nan")}, r"delta must be in \[0, 1\]"),
    ({"method": "csd", "filter": "l2"}, "unknown filter"),
    ({"method": "sjd", "lam": 0.5}, r"unknown option\(s\) \['lam'\] for method 'sjd'"),
    ({"method": "csd", "window": 0}, "window must be an integer in"),
    ({"method": "csd", "window": 2.5}, "window must be an integer in"),
    ({"method": "csd", "window": 16.0}, "window must be an integer in"),
    ({"method": "csd", "window": True}, "window must be an integer in"),
    ({"method": "csd", "window": 10**6}, "window must be an integer in"),
    ({"method": "csd", "window": "fast"}, "window must be an integer in"),
    ({"method": "csd", "temperature": 0}, "temperature must be"),
    ({"method": "csd", "temperature": 1e-300}, "temperature must be"),
    ({"method": "csd", "temperature": float("inf")}, "temperature must be"),
    ({"method": "csd", "temperature": "hot"}, "temperature must be"),
    ({"method": "csd", "cfg_scale": 1e300}, "cfg_scale must be a number in"),
    ({"method": "csd", "cfg_scale": float("nan")}, "cfg_scale must be a number in"),
    ({"method": "csd", "top_p": 0}, "top_p must be in"),
    ({"method": "csd", "top_p": 1.5}, "top_p must be in"),
    ({"method": "csd", "top_k": -3}, "top_k must be a positive integer"),
    ({"method": "csd", "top_k": True}, "top_k must be a positive integer"),
    ({"method": "csd", "top_k": 2.5}, "top_k must be a positive integer"),
    ({"method": "amplify", "k": 0.5}, "amplify k must be >= 1"),
    ({"method": "gsd", "group_size": 0}, "group_size must be an integer in"),
    ({"method": "gsd", "group_size": 10**9}, "group_size must be an integer in"),
    ({"method": "gsd", "group_size": 3.0}, "group_size must be an integer in"),
    ({"method": "lantern", "k": 10**7}, "lantern k must be an integer in"),
    ({"method": "csd", "draft_init": "zeros"}, "unknown draft_init"),
    ({"method": "csd", "coupling": "tight"}, "unknown coupling"),
    ({"method": "csd", "advance": "sideways"}, "unknown advance"),
    ({"method": "ar", "delta": 0.3}, "method 'ar' takes no options"),
    ({"method": "csd", "seed": "zero"}, "seed must be an integer"),
    ({"method": "csd", "seed": -1}, "seeds must be integers in"),
    ({"method": "csd", "seed": [1, 2]}, "got 2 seeds for 1 prompts"),
    ({"method": "csd", "max_batch": 0}, "max_batch must be an integer >= 1"),
])
def test_bad_options(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sp.generate(tiny, [1], **kwargs)


def test_bad_prompts_and_models(tiny, tmp_path):
    with pytest.raises(ValueError, match="class ids"):
        sp.generate(tiny, ["a cat"])
    with pytest.raises(ValueError, match="prompts is empty"):
        sp.generate(tiny, [])
    with pytest.raises(ValueError, match="unknown model 'janus-pro-9000'"):
        sp.load_model("janus-pro-9000")
    with pytest.raises(ValueError, match="grid must be"):
        sp.load_model("tiny", grid=(0, 3))
    with pytest.raises(ValueError, match=r"bad option\(s\) \['colour'\] for model 'tiny'"):
        sp.load_model("tiny", colour="red")
    with pytest.raises(ValueError, match="builtin.safetensors"):
        sp.load_model("builtin", str(tmp_path))


def test_rule_input_shapes():
    rule = sp.acceptance.get("sjd")
    probs = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match=r"must both be \[batch, window, vocab\]"):
        rule.acceptance_probs(torch.zeros(1, 2, dtype=torch.long), probs, probs[:, :1])
    with pytest.raises(ValueError, match="draft_tokens must be"):
        rule.acceptance_probs(torch.zeros(1, 3, dtype=torch.long), probs, probs)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        rule.acceptance_probs(torch.tensor([[0, 9]]), probs, probs)
    with pytest.raises(ValueError, match="NaN"):
        rule.acceptance_probs(torch.zeros(1, 2, dtype=torch.long), probs * float("nan"), probs)
    with pytest.raises(ValueError, match="codebook"):
        sp.acceptance.get("lantern")


def test_nan_logits_are_reported(tiny):
    broken = copy.deepcopy(tiny)
    with torch.no_grad():
        broken.decoder.head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN logits"):
        sp.generate(broken, [1], method="csd")


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.float16(0.5)])
def test_numpy_scalars_of_any_width_are_numbers(tiny, value):
    out = sp.generate(tiny, [1], method="csd", lam=value, delta=value, decode_images=False)
    assert out.tokens.shape == (1, 15)


def test_numpy_integers_are_integers(tiny):
    out = sp.generate(tiny, [1], method="csd", window=np.int64(4), top_k=np.int32(3),
                      decode_images=False)
    assert out.tokens.shape == (1, 15)


def test_infinite_logits_are_reported():
    from speculaas.sampling import target_probs

    with pytest.raises(ValueError, match="infinite logits"):
        target_probs(torch.tensor([[0.0, float("inf")]]), None, SamplingConfig())


def test_guidance_overflow_is_reported_not_silent():
    # Finite logits whose guided combination overflows float32: the probabilities would be NaN
    # and every token the last id.
    from speculaas.sampling import target_probs

    cond, uncond = torch.tensor([[3e38, 0.0]]), torch.tensor([[-3e38, 0.0]])
    with pytest.raises(ValueError, match="not finite after guidance.*cfg_scale=2.0"):
        target_probs(cond, uncond, SamplingConfig(cfg_scale=2.0))


@pytest.mark.parametrize("device,match", [("tpu", "unknown device"), ("cuda:7", "cuda"),
                                          (3.5, "unknown device")])
def test_bad_devices(device, match):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(ValueError, match=match):
        sp.load_model("tiny", device=device)


def test_bad_dtype(tmp_path):
    from speculaas.models.hf import load_checkpoint

    (tmp_path / "config.json").write_text('{"model_type": "janus"}')
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        load_checkpoint(object, str(tmp_path), "janus", "float13")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        sp.load_model("builtin", dtype="int8")


@pytest.mark.parametrize("method,window", [("sjd", "auto"), ("csd", 8)])
def test_large_batches_run_in_chunks_with_the_same_images(tiny, method, window):
    # sjd: sample-exact, so the same under the window policy whatever window each chunk takes;
    # a relaxed rule's sample depends on the window, so it keeps one here.
    whole = sp.generate(tiny, [1, 2, 3, 4, 5], method=method, seed=3, window=window,
                        decode_images=False)
    chunked = sp.generate(tiny, [1, 2, 3, 4, 5], method=method, seed=3, max_batch=2,
                          window=window, decode_images=False)
    assert torch.equal(whole.tokens, chunked.tokens)
    if window != "auto":
        assert torch.equal(whole.forward_passes, chunked.forward_passes)


@pytest.mark.parametrize("caption,match", [
    ("a cat sitting on a sofa", "does not know"),
    ("red big circle on the left over grass", "nearest valid caption: 'a big red circle on the "
                                              "left over grass'"),
    ("a big red circle", "does not follow the built-in grammar"),
    ("", "does not follow the built-in grammar"),
    (42, "caption strings"),
])
def test_builtin_captions_are_checked_against_the_grammar(caption, match):
    from speculaas.models.builtin.scenes import parse_caption

    with pytest.raises(ValueError, match=match):
        parse_caption(caption)


NATURAL = {  # what a newcomer types -> what the model was trained on
    "a red circle in the center over grass": "a big red circle on the center over grass",
    "a blue square on the left": "a big blue square on the left under a blue sky",
    "a red circle on the left and a blue square on the right over grass":
        "a big red circle on the left over grass and a small blue square on the right",
    "over grass, a red circle on the left": "a big red circle on the left over grass",
    "a large green triangle in the middle at sunset":
        "a big green triangle on the center at sunset",
    "A red circle on the left on a plain gray background":
        "a big red circle on the left on a plain grey background",
    "a small white diamond on the right against a brick wall":
        "a small white diamond on the right in front of a brick wall",
}


@pytest.mark.parametrize("caption", NATURAL)
def test_natural_captions_map_onto_the_grammar(caption, builtin):
    from speculaas.models.builtin.judge import caption_labels
    from speculaas.models.builtin.scenes import parse_caption

    assert parse_caption(caption) == NATURAL[caption]
    assert caption_labels(caption) == caption_labels(NATURAL[caption])
    builtin.check_prompts([caption])


@pytest.mark.parametrize("caption,hint", [
    ("a red circle on the left and a blue square over grass",
     "a big red circle on the left over grass and a small blue square in the middle"),
    ("a big purple diamond", "a big purple diamond on the left under a blue sky"),
    ("two blue squares over grass",
     "a big blue square on the left over grass and a small blue square on the right"),
    ("a pair of red circles", "a big red circle on the left under a blue sky and a small red "
                              "circle on the right"),
])
def test_refusal_hints_keep_every_object_the_user_named(caption, hint):
    from speculaas.models.builtin.scenes import parse_caption

    with pytest.raises(ValueError, match=f"'{hint}'"):
        parse_caption(caption)
    assert parse_caption(hint)  # the hint itself is a caption the model takes


def test_a_caption_of_something_else_hears_what_the_model_draws():
    from speculaas.models.builtin.scenes import parse_caption

    with pytest.raises(ValueError, match="it draws one or two shapes, circle, square"):
        parse_caption("a cat")


def test_builtin_captions_ignore_case_and_punctuation():
    from speculaas.models.builtin.scenes import parse_caption

    assert parse_caption("A big RED circle, on the left; over grass.") == \
        "a big red circle on the left over grass"


@pytest.mark.parametrize("content,match", [
    ('{"annotations": [{"id": 1, "caption": "x"}]}', "lacks image_id"),
    ("[1, 2]", "not an MS-COCO captions file"),
    ("{not json", "not valid JSON"),
])
def test_bad_coco_files(tmp_path, content, match):
    from speculaas.bench.prompts import load_prompts

    (tmp_path / "c.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(str(tmp_path / "c.json"))


def test_bad_checkpoint_files(tmp_path):
    torch.save(torch.zeros(3), tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="holds a Tensor, not a state dict"):
        sp.load_model("llamagen", str(tmp_path / "bare.pt"))
    (tmp_path / "builtin.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "training.json").write_text("[]")
    with pytest.raises(ValueError, match="not a training record"):
        sp.load_model("builtin", str(tmp_path))


def test_interrupted_image_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    from PIL import Image

    from speculaas.io import save_image

    path = tmp_path / "out.png"
    save_image(Image.new("RGB", (8, 8), "red"), path)
    before = path.read_bytes()
    real_save = Image.Image.save

    def save_half_then_interrupt(self, fp, *args, **kwargs):
        real_save(self, fp, *args, **kwargs)
        with open(fp, "r+b") as f:  # the write was cut short...
            f.truncate(10)
        raise KeyboardInterrupt  # ...by Ctrl-C

    monkeypatch.setattr(Image.Image, "save", save_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_image(Image.new("RGB", (8, 8), "blue"), path)
    assert path.read_bytes() == before  # the previous image, whole
    assert [p.name for p in tmp_path.iterdir()] == ["out.png"]  # no temporary file left


def test_cli_refuses_unwritable_output_before_loading_anything(tmp_path):
    import subprocess
    import sys

    (tmp_path / "a-file").write_text("")  # a file where the output folder should be
    res2 = subprocess.run([sys.executable, "-m", "speculaas.cli", "generate", "--prompt",
                           "a big red circle on the left over grass", "--out",
                           str(tmp_path / "a-file" / "x.png")],
                          capture_output=True, text=True, timeout=60)
    assert res2.returncode == 2 and "cannot write" in res2.stderr
    assert "Traceback" not in res2.stderr


def test_object_count_counts_separate_blobs_of_a_colour():
    import numpy as np

    from speculaas.bench.metrics import object_count
    from speculaas.models.builtin.scenes import COLOURS, render_scene

    img = np.full((64, 64, 3), 120, np.uint8)
    assert object_count(img, COLOURS["red"]) == 0
    img[10:25, 5:20] = COLOURS["red"]
    assert object_count(img, COLOURS["red"]) == 1
    img[40:55, 40:55] = COLOURS["red"]
    img[30:32, 30:32] = COLOURS["red"]  # a speck, not an object
    assert object_count(img, COLOURS["red"]) == 2
    assert object_count(img, COLOURS["blue"]) == 0
    hits = sum(object_count(sc.image, COLOURS[sc.objects[0].colour]) == 1
               for sc in (render_scene(90_000_000 + i) for i in range(40))
               if len(sc.objects) == 1)
    assert hits >= 25  # of the ~28 one-object scenes: the counter reads ground truth


@pytest.mark.parametrize("bad", ["builtin", None, 3])
def test_generate_wants_a_loaded_model(bad):
    with pytest.raises(ValueError, match="model must be a loaded model"):
        sp.generate(bad, ["a red circle"])


def _builtin_copy(tmp_path):
    import shutil

    from speculaas.models.builtin.model import WEIGHTS_DIR

    folder = tmp_path / "weights"
    shutil.copytree(WEIGHTS_DIR, folder)
    return folder


def test_one_flipped_bit_in_the_builtin_weights_is_named(tmp_path):
    folder = _builtin_copy(tmp_path)
    data = bytearray((folder / "builtin.safetensors").read_bytes())
    data[-1000] ^= 0x10  # inside a tensor: safetensors itself reads it without complaint
    (folder / "builtin.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="builtin.safetensors is damaged"):
        sp.load_model("builtin", str(folder))


def test_a_bad_configuration_in_the_training_record_is_one_line(tmp_path):
    import json

    folder = _builtin_copy(tmp_path)
    record = json.loads((folder / "training.json").read_text())
    record["decoder_config"]["n_heads"] = 0
    (folder / "training.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="bad model configuration"):
        sp.load_model("builtin", str(folder))


def test_bench_on_a_folder_it_cannot_write_is_one_line(tmp_path, capsys):
    import os

    from speculaas.cli import main

    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere")
        with pytest.raises(SystemExit) as exited:
            main(["bench", "--model", "tiny", "--prompts", "classes", "--limit", "1",
                  "--methods", "ar", "--out", str(locked / "run")])
    finally:
        os.chmod(locked, 0o700)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Permission denied" in err and "Traceback" not in err


def test_an_oserror_below_the_cli_is_one_line(tmp_path, capsys):
    from speculaas.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where --out's folder should be
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--model", "tiny", "--prompts", "classes", "--limit", "1",
              "--methods", "ar", "--out", str(blocker / "run")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "speculaas: error:" in err and "Traceback" not in err
