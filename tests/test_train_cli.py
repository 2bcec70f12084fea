"""`speculaas train` / `python -m speculaas.models.builtin.train` with bad options or damaged
runs: one line naming the problem, exit 2, no traceback, nothing trained, nothing lost."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import TINY

from speculaas.models.builtin import train

MODULE = [sys.executable, "-m", "speculaas.models.builtin.train"]


def run(args):
    return subprocess.run(MODULE + args, capture_output=True, text=True)


def tiny(out, *extra):
    """TINY with later flags winning (argparse keeps the last)."""
    return ["--out", str(out), *TINY, *extra]


@pytest.mark.parametrize("extra,match", [
    (["--vq-steps", "0"], "--vq-steps must be >= 1"),
    (["--vq-steps", "-5"], "--vq-steps must be >= 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--device", "foo"], "is not a device"),
    (["--vq-lr", "nan"], "--vq-lr must be a learning rate"),
    (["--vq-lr", "1e12"], "--vq-lr must be a learning rate"),
    (["--ar-scenes", "0"], "--ar-scenes must be >= 1"),
    (["--n-heads", "3"], "--n-heads 3 must divide --d-model 32"),
    (["--ar-batch", "0"], "--ar-batch must be >= 1"),
    (["--caption-dropout", "1.5"], "--caption-dropout is a probability"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, extra, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        train.main(tiny(tmp_path / "run", *extra))
    assert not (tmp_path / "run").exists()  # checked before anything was written


def test_the_module_prints_one_line_and_exits_2(tmp_path):
    res = run(tiny(tmp_path / "run", "--vq-steps", "-5"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip() == "speculaas train: error: --vq-steps must be >= 1, got -5"


def test_cuda_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA device"):
        train.main(tiny(tmp_path / "run", "--device", "cuda"))


def test_bad_out_folders(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, match in ((a_file, "is a file"), ("", "must name a folder")):
        with pytest.raises(ValueError, match=match):
            train.main(["--out", str(out), *TINY])
    assert a_file.read_text() == "x"


def test_the_speculaas_command_gives_the_same_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "speculaas.cli", "train", "--out",
                          str(tmp_path / "r"), "--threads", "0"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == (
        "speculaas: error: --threads must be >= 1, got 0")


def test_resume_names_the_settings_that_differ_and_ignores_threads(tmp_path):
    import dataclasses

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    given = {a.lstrip("-").replace("-", "_"): v for a, v in zip(TINY[::2], TINY[1::2])}
    base = train.TrainConfig()
    stored = {f.name: type(getattr(base, f.name))(given.get(f.name, getattr(base, f.name)))
              for f in dataclasses.fields(base)}
    (out / "checkpoints" / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match=r"ar-lr 0\.001 -> 0\.002"):
        train.main(tiny(out, "--ar-lr", "0.002"))
    train.main(tiny(out, "--threads", "2"))  # threads is not a setting: resumes, trains
    assert (out / "builtin.safetensors").is_file()


def test_damaged_runs_name_the_file(tmp_path):
    out = tmp_path / "run"
    train.main(tiny(out))
    config = out / "checkpoints" / "config.json"
    good = config.read_text()
    config.write_text(good[: len(good) // 2])  # torn
    with pytest.raises(ValueError, match="config.json is damaged"):
        train.main(tiny(out))
    config.write_text(good)
    refine = out / "checkpoints" / "transformer-refine.pt"
    data = refine.read_bytes()
    refine.write_bytes(data[: len(data) // 2])  # half a checkpoint
    with pytest.raises(ValueError, match="transformer-refine.pt is damaged"):
        train.main(tiny(out))
    refine.write_bytes(data)
    config.unlink()  # the options are gone, and the new ones do not fit the checkpoints
    with pytest.raises(ValueError, match=r"tokenizer.pt|transformer.*does not fit"):
        train.main(tiny(out, "--d-model", "64"))


def test_a_diverging_stage_stops_with_its_name(tmp_path, monkeypatch):
    import torch

    real = torch.nn.functional.cross_entropy

    def nan_loss(*a, **k):
        return real(*a, **k) * float("nan")

    monkeypatch.setattr(train.F, "cross_entropy", nan_loss)
    with pytest.raises(ValueError, match="stage 'judge' diverged"):
        train.main(tiny(tmp_path / "run"))


def test_an_out_folder_that_cannot_be_written(tmp_path):
    """T10: a read-only --out is refused in one line before any work. Root writes through
    permission bits, so there the folder is one the kernel refuses to create (under /proc)."""
    if os.geteuid() == 0:
        out = Path("/proc/speculaas-read-only/run")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        out = ro / "run"
    res = subprocess.run([sys.executable, "-m", "speculaas.cli", "train", "--out", str(out),
                          *TINY], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "cannot write" in res.stderr
