"""`speculaas train`: a run killed after a checkpoint resumes to the same weights as a run that
was never interrupted (a tiny configuration, a few steps of each stage)."""

import pytest
from safetensors.torch import load_file

from speculaas.models.builtin import train

TINY = ["--vq-steps", "3", "--judge-steps", "2", "--ar-scenes", "32", "--ar-steps", "4",
        "--ar-refine-steps", "4", "--ar-batch", "4", "--vq-batch", "4", "--judge-batch", "8", "--d-model", "32",
        "--n-layers", "1", "--n-heads", "2", "--checkpoint-every", "2", "--threads", "1"]


class Killed(Exception):
    pass


@pytest.mark.parametrize("stage", ["transformer", "transformer-refine"])
def test_killed_run_resumes_to_the_same_weights(tmp_path, monkeypatch, stage):
    train.main(["--out", str(tmp_path / "whole"), *TINY])
    real = train._Stage.checkpoint

    def kill_after_second_step(self, step, every, **parts):
        real(self, step, every, **parts)
        if self.name == stage and step + 1 == 2:
            raise Killed

    monkeypatch.setattr(train._Stage, "checkpoint", kill_after_second_step)
    with pytest.raises(Killed):
        train.main(["--out", str(tmp_path / "split"), *TINY])
    monkeypatch.undo()
    train.main(["--out", str(tmp_path / "split"), *TINY])  # resumes at step 2 of that stage
    whole = load_file(str(tmp_path / "whole" / "builtin.safetensors"))
    split = load_file(str(tmp_path / "split" / "builtin.safetensors"))
    assert whole.keys() == split.keys()
    assert all((whole[k] == split[k]).all() for k in whole)


def test_resume_with_other_settings_is_refused(tmp_path):
    train.main(["--out", str(tmp_path), *TINY])
    with pytest.raises(ValueError, match="other settings"):
        train.main(["--out", str(tmp_path), *TINY, "--ar-lr", "0.002"])
