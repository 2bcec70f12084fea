"""The command line: generate writes the image(s) and the acceptance map; errors are one line."""

import subprocess
import sys

from PIL import Image

CLI = [sys.executable, "-m", "speculaas.cli"]


def test_generate_writes_images_and_map(tmp_path):
    out = tmp_path / "img.png"
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "3", "--prompt", "5",
                                "--num-images", "2", "--method", "csd", "--delta", "0.8",
                                "--out", str(out)], capture_output=True, text=True, check=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["img-0.png", "img-1.png", "img-2.png", "img-3.png", "img.map.png"]
    assert Image.open(tmp_path / "img-0.png").size == (4 * 4 * 8, 4 * 4 * 8)
    assert "forward passes for 16 tokens" in res.stdout and "latency" in res.stdout


def test_bad_flags_give_one_line_errors(tmp_path):
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "3", "--delta", "2",
                                "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip() == "speculaas: error: delta must be in [0, 1], got 2.0"
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "cat",
                                "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert res.returncode == 2 and "class ids" in res.stderr and "Traceback" not in res.stderr


def test_row_context_flag(tmp_path):
    out = tmp_path / "img.png"
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "3", "--method", "sjd",
                                "--row-context", "1", "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "forward passes for 16 tokens" in res.stdout
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "3", "--method", "ar",
                                "--row-context", "1", "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "needs a speculative method" in res.stderr


def test_train_takes_the_documented_options(tmp_path, monkeypatch):
    """`speculaas train --out DIR ...` (the README's command) reaches the training script with
    its options; --help lists them; unknown options of other commands stay errors."""
    from speculaas import cli
    from speculaas.models.builtin import train

    seen = {}
    monkeypatch.setattr(train, "train", lambda cfg, out: seen.update(cfg=cfg, out=out))
    cli.main(["train", "--out", str(tmp_path / "run"), "--ar-steps", "7"])
    assert seen["out"] == tmp_path / "run" and seen["cfg"].ar_steps == 7
    res = subprocess.run(CLI + ["train", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--out" in res.stdout and "--ar-steps" in res.stdout
    res = subprocess.run(CLI + ["captions", "--out", "x"], capture_output=True, text=True)
    assert res.returncode == 2 and "unrecognized arguments: --out x" in res.stderr


def test_sjd_and_ar_write_the_same_picture_for_a_seed(tmp_path):
    """The README's promise, through the command line on the built-in model (window auto)."""
    caption = "a big red circle on the left over grass"
    outs = {}
    for method in ("ar", "sjd"):
        outs[method] = tmp_path / f"{method}.png"
        res = subprocess.run(CLI + ["generate", "--prompt", caption, "--method", method,
                                    "--seed", "3", "--out", str(outs[method])],
                             capture_output=True, text=True, check=True)
        assert "latency" in res.stdout
    assert outs["ar"].read_bytes() == outs["sjd"].read_bytes()
    ratio = tmp_path / "ratio.png"
    subprocess.run(CLI + ["generate", "--prompt", caption, "--method", "sjd", "--seed", "3",
                          "--verify", "ratio", "--window", "16", "--out", str(ratio)],
                   capture_output=True, text=True, check=True)
    assert ratio.read_bytes() != outs["ar"].read_bytes()  # the comparison can tell


def test_model_options_that_clash_with_flags_are_refused(tmp_path):
    for opt, flag in (("path=/tmp", "--weights"), ("dtype=bfloat16", "--dtype")):
        res = subprocess.run(CLI + ["generate", "--dtype", "float32", "--model-opt", opt,
                                    "--prompt", "a big red circle on the left over grass",
                                    "--out", str(tmp_path / "x.png")],
                             capture_output=True, text=True)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and flag in res.stderr


def test_help_shows_each_methods_real_defaults():
    import dataclasses

    from speculaas import acceptance
    from speculaas.config import RULE_DEFAULTS

    for method, opts in RULE_DEFAULTS.items():
        cls = acceptance.RULES[method]
        real = {f.name: f.default for f in dataclasses.fields(cls)
                if f.name in acceptance.options(method)}
        assert real == opts, method
    res = subprocess.run(CLI + ["generate", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(res.stdout.split())
    assert "option of csd (default 0.65), lantern (default 0.1)" in text
    assert "(default: None)" not in text


def test_help_states_each_adapters_sampling_defaults():
    from speculaas.cli import SAMPLING_DEFAULTS
    from speculaas.models import chameleon, emu3, janus, llamagen
    from speculaas.models.builtin import model as builtin

    real = {"builtin": builtin.DEFAULTS, "janus": janus.DEFAULTS,
            "lumina-mgpt": chameleon.DEFAULTS, "emu3": emu3.DEFAULTS,
            "llamagen c2i": llamagen.C2I_DEFAULTS, "llamagen t2i": llamagen.T2I_DEFAULTS}
    assert real.keys() == SAMPLING_DEFAULTS.keys()
    for name, d in real.items():
        assert d.top_p is None, name  # the help says: off for every adapter
        assert SAMPLING_DEFAULTS[name] == {"temperature": d.temperature, "top_k": d.top_k,
                                           "cfg_scale": d.cfg_scale}, name
    res = subprocess.run(CLI + ["generate", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(res.stdout.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert ("(builtin 3, janus 5, lumina-mgpt 3, emu3 3, llamagen c2i 4, llamagen t2i 7.5); 1 "
            "switches CFG off") in text
    assert "(builtin off, janus off, lumina-mgpt 2000, emu3 2048" in text


def test_train_drafter_then_generate_with_the_head(tmp_path):
    head = tmp_path / "head"
    res = subprocess.run(CLI + ["train-drafter", "--model", "tiny", "--out", str(head),
                                "--images", "32", "--batch", "16", "--steps", "6", "--chains",
                                "16", "--unroll", "2", "--width", "16", "--blocks", "1",
                                "--depth", "3", "--prior-prompts", "0"],
                         capture_output=True, text=True, check=True)
    assert (head / "head.safetensors").is_file() and "head.json" in res.stdout + res.stderr
    out = tmp_path / "img.png"
    res = subprocess.run(CLI + ["generate", "--model", "tiny", "--prompt", "3", "--method", "sjd",
                                "--drafter", str(head), "--draft-depth", "2", "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "forward passes for 16 tokens" in res.stdout
    for args, message in [
        (["train-drafter", "--model", "tiny", "--out", str(head), "--steps", "0"],
         "speculaas: error: steps must be an integer >= 1, got 0"),
        (["train-drafter", "--model", "toy", "--out", str(head)],
         "speculaas: error: model 'toy' does not give a draft head its features yet "
         "(train-drafter runs on builtin, tiny, llamagen, janus, lumina-mgpt, chameleon, anole, "
         "emu3)"),
        (["generate", "--model", "tiny", "--prompt", "3", "--method", "sjd", "--drafter",
          str(tmp_path / "none"), "--out", str(out)], None),
    ]:
        res = subprocess.run(CLI + args, capture_output=True, text=True)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        line = res.stderr.strip()
        assert len(line.splitlines()) == 1, line
        if message is not None:
            assert line == message
