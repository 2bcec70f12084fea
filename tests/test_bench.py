"""`speculaas bench`: prompt files, resume after a kill, and sharding under torchrun."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from speculaas.bench.prompts import load_prompts
from speculaas.bench.runner import Variant, expand_sweeps, read_log

BENCH = [sys.executable, "-m", "speculaas.cli", "bench", "--model", "tiny", "--prompts",
         "classes", "--limit", "5", "--seeds", "2", "--methods", "ar,sjd,csd:delta=0.8,gsd",
         "--maps", "1"]
DETERMINISTIC = ("items", "forward_passes_mean", "step_compression", "accept_hist",
                 "drafted_share_by_detail_quintile")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _summary(folder):
    s = json.loads((folder / "summary.json").read_text())
    return {lab: {k: v[k] for k in DETERMINISTIC} for lab, v in s["variants"].items()}


def _tokens(folder):
    rows = []
    for p in folder.glob("results.rank*.jsonl"):
        rows += read_log(p)[0]
    return sorted((r["variant"], r["prompt_index"], r["seed"], tuple(r["tokens"])) for r in rows)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-full")
    subprocess.run(BENCH + ["--out", str(out)], check=True, env=ENV, capture_output=True)
    return out


def test_outputs_written(uninterrupted):
    for name in ("table.md", "summary.json", "pareto.png", "maps/prompt0.png"):
        assert (uninterrupted / name).is_file(), name
    table = (uninterrupted / "table.md").read_text()
    assert "| csd(delta=0.8) | 10 |" in table and "quality metrics skipped" in table


def test_kill_and_resume_gives_the_same_table(uninterrupted, tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.Popen(BENCH + ["--out", str(out)], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    results = out / "results.rank0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if results.exists() and len(results.read_text().splitlines()) >= 15:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(results.read_text().splitlines())
    assert 15 <= done < 40, done  # really stopped halfway
    subprocess.run(BENCH + ["--out", str(out), "--resume"], check=True, env=ENV,
                   capture_output=True)
    assert _summary(out) == _summary(uninterrupted)
    assert _tokens(out) == _tokens(uninterrupted)


def test_torn_and_corrupt_lines_lose_no_completed_row(uninterrupted, tmp_path):
    """A kill mid-line leaves a torn last line; garbage may sit anywhere. Resume drops the torn
    line (re-running its item), reports bad lines by number and keeps every valid row."""
    out = tmp_path / "bench"
    out.mkdir()
    lines = (uninterrupted / "results.rank0.jsonl").read_text().splitlines(keepends=True)
    half = lines[20][: len(lines[20]) // 2]  # the row being written when the kill came
    log = out / "results.rank0.jsonl"
    log.write_text("".join(lines[:7]) + "{}\n" + "not json\n" + "".join(lines[7:20]) + half)
    rows, notes = read_log(log)
    assert len(rows) == 20
    assert any("line 8" in n and "missing" in n for n in notes)
    assert any("line 9" in n and "not JSON" in n for n in notes)
    assert any("torn last line" in n for n in notes)
    res = subprocess.run(BENCH + ["--out", str(out), "--resume"], env=ENV, capture_output=True,
                         text=True, check=True)
    assert "torn last line" in res.stdout and "line 9: not JSON" in res.stdout
    assert _summary(out) == _summary(uninterrupted)
    assert _tokens(out) == _tokens(uninterrupted)


def test_resume_with_other_settings_is_refused(uninterrupted, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.rank0.jsonl").write_text(
        (uninterrupted / "results.rank0.jsonl").read_text())
    res = subprocess.run(BENCH + ["--out", str(out), "--resume", "--window", "8"], env=ENV,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "other settings" in res.stderr and "'window': None" in res.stderr


def test_torchrun_two_processes_match_one(uninterrupted, tmp_path):
    out = tmp_path / "bench2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "speculaas.cli", *BENCH[3:], "--out", str(out)]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p.name for p in out.glob("results.rank*.jsonl")} == {"results.rank0.jsonl",
                                                                 "results.rank1.jsonl"}
    ranks = {json.loads(line)["rank"] for p in out.glob("results.rank*.jsonl")
             for line in p.read_text().splitlines()}
    assert ranks == {0, 1}
    assert _tokens(out) == _tokens(uninterrupted)
    assert _summary(out) == _summary(uninterrupted)


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("a red circle\n\nblue sky\n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["a red circle", "blue sky"]
    (tmp_path / "p.tsv").write_text("id\tcaption\n1\tfirst one\n2\tsecond\n")
    assert load_prompts(str(tmp_path / "p.tsv"), limit=1) == ["first one"]
    (tmp_path / "p.csv").write_text('prompt,x\n"a, b",1\n')
    assert load_prompts(str(tmp_path / "p.csv")) == ["a, b"]
    coco = {"annotations": [{"image_id": 9, "id": 5, "caption": "later image"},
                            {"image_id": 3, "id": 8, "caption": "second caption"},
                            {"image_id": 3, "id": 2, "caption": "first caption "}]}
    (tmp_path / "c.json").write_text(json.dumps(coco))
    assert load_prompts(str(tmp_path / "c.json")) == ["first caption", "later image"]
    with pytest.raises(ValueError, match="not found"):
        load_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="no caption/prompt/text column"):
        (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
        load_prompts(str(tmp_path / "bad.csv"))


def test_variants_and_sweeps():
    v = expand_sweeps([Variant.parse("ar"), Variant.parse("csd:delta=0.35:lam=0.5")],
                      ["csd.delta=0.35,0.8"])
    assert [x.label for x in v] == ["ar", "csd(delta=0.35,lam=0.5)", "csd(delta=0.35)",
                                    "csd(delta=0.8)"]
    with pytest.raises(ValueError, match="unknown method"):
        Variant.parse("fast")
    with pytest.raises(ValueError, match="bad sweep"):
        expand_sweeps([], ["csd=0.3"])


def test_latency_script_runs_on_cpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "gpu_latency.py"
    spec = importlib.util.spec_from_file_location("gpu_latency", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    speedups = script.main(["--model", "tiny", "--device", "cpu", "--batches", "1,2",
                            "--windows", "4,auto", "--groups", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == speedups
    assert speedups["ar@batch1"] == 1.0 and "csd(delta=0.65,W=auto)@batch2" in speedups
    assert sum("| sjd(W=4) |" in line for line in lines) == 2
    for name in ("emu3", "llamagen"):  # an adapter's tiny random checkpoint, one window
        speedups = script.main(["--model", name, "--random", "--device", "cpu", "--batches", "1",
                                "--windows", "4", "--groups", "1"])
        assert speedups["ar@batch1"] == 1.0 and "sjd(W=4)@batch1" in speedups


def test_rows_benchmark_checks_its_targets():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "rows.py"
    spec = importlib.util.spec_from_file_location("rows_bench", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def variant(fwd, fidelity, se, fid):
        return {"forward_passes_mean": fwd, "step_compression": 256 / fwd, "speedup_vs_ar": 1.0,
                "prompt_fidelity": fidelity, "prompt_fidelity_se": se, "fid_vs_rendered": fid}

    summary = {"variants": {"ar": variant(256, 0.80, 0.02, 10.0),
                            "good": variant(60, 0.78, 0.02, 10.5),
                            "blurry": variant(50, 0.70, 0.02, 10.5),
                            "slow": variant(100, 0.80, 0.02, 10.0),
                            "smeared": variant(50, 0.80, 0.02, 12.0)}}
    out = script.verdicts(summary)
    assert out["good"]["meets_targets"] and out["good"]["fidelity_within_noise"]
    assert not out["blurry"]["meets_targets"]  # 0.10 below AR, noise +-0.057
    assert not out["slow"]["meets_targets"]  # 2.56x steps
    assert not out["smeared"]["meets_targets"]  # FID 20 % above AR's
    assert "row_context=2" in " ".join(script.VARIANTS)


def test_latency_spread_and_contention_warning():
    from speculaas.bench.report import contention_note, pair_speedups

    ar = [{"prompt_index": i, "seed": 0, "latency_s": 1.0} for i in range(4)]
    rows = [{"prompt_index": i, "seed": 0, "latency_s": t} for i, t in enumerate([1, 2, 4, 8])]
    med, q1, q3 = pair_speedups(ar, rows)
    assert (med, q1, q3) == (0.375, 0.21875, 0.625)
    assert pair_speedups(ar, rows[:1]) is None
    assert contention_note("sjd", 2.2, 2.0) is None  # within the margin
    note = contention_note("sjd", 5.03, 2.27)  # the busy machine the first-run issue saw
    assert "5.03x faster than AR with only 2.27x fewer forwards" in note


def test_cost_curve_file_models_the_speed_up(tmp_path):
    curve = tmp_path / "flat.json"
    curve.write_text(json.dumps({str(w): 0.01 for w in (0, 1, 2, 4, 8, 16, 32, 64, 128)}))
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "speculaas.cli", "bench", "--model", "tiny", "--prompts",
           "classes", "--limit", "2", "--seeds", "1", "--maps", "0", "--out", str(out),
           "--methods", "ar,sjd:window=16,sjd:window=32:tree=3x2,sjd", "--cost-curve",
           str(curve)]
    subprocess.run(cmd, check=True, env=ENV, capture_output=True)
    s = json.loads((out / "summary.json").read_text())["variants"]
    for lab, v in s.items():  # a flat curve: the modelled speed-up is the step compression
        assert abs(v["modelled_speedup"] - 16 / (16 / v["step_compression"])) < 0.35, lab
    assert "modelled speed-up" in (out / "table.md").read_text()
    rows = [json.loads(line) for line in (out / "results.rank0.jsonl").read_text().splitlines()]
    auto = [r for r in rows if r["variant"] == "sjd"]
    assert all(max(map(int, r["windows"])) > 1 for r in auto)  # auto on a flat curve speculates
    curve.write_text("[1, 2]")
    bad = subprocess.run(cmd[:-1] + [str(curve)], env=ENV, capture_output=True, text=True)
    assert bad.returncode == 2 and "must map windows" in bad.stderr


def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    from speculaas.bench.runner import _hold_out

    out = tmp_path / "bench"
    out.mkdir()
    held = _hold_out(out, 0)  # another run, writing there
    res = subprocess.run(BENCH + ["--out", str(out), "--resume"], env=ENV, capture_output=True,
                         text=True)
    held.close()
    assert res.returncode == 2 and "another bench run is writing to" in res.stderr
    assert "Traceback" not in res.stderr and not list(out.glob("results.rank*.jsonl"))
