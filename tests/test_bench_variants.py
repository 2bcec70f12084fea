"""`speculaas bench --methods`: variant specs are checked while parsing, and every variant's
values before anything in --out is touched."""

import subprocess
import sys

import pytest

from speculaas.bench.runner import Variant

CLI = [sys.executable, "-m", "speculaas.cli"]


@pytest.mark.parametrize("spec,match", [
    ("csd:seed=3", "unknown option 'seed'"), ("csd:method=sjd", "unknown option 'method'"),
    ("csd:decode_images=0", "unknown option 'decode_images'"),
    ("csd:profile=0", "unknown option 'profile'"), ("csd:prompts=1", "unknown option 'prompts'"),
    ("csd:model=builtin", "unknown option 'model'"),
    ("csd:delta=0.5:delta=0.9", "given twice"), ("csd:detla=0.5", "unknown option 'detla'"),
])
def test_bad_variant_specs_are_refused_while_parsing(spec, match):
    with pytest.raises(ValueError, match=match):
        Variant.parse(spec)


def test_good_specs_parse():
    v = Variant.parse("csd:delta=0.35:window=auto:verify=ratio")
    assert v.options == {"delta": 0.35, "window": "auto", "verify": "ratio"}


def bench(tmp_path, methods, *extra):
    return subprocess.run(CLI + ["bench", "--model", "tiny", "--prompts", "classes", "--limit",
                                 "1", "--seeds", "1", "--methods", methods, "--out",
                                 str(tmp_path), *extra], capture_output=True, text=True)


def test_an_empty_method_list_is_refused(tmp_path):
    res = bench(tmp_path / "out", ",,,")
    assert res.returncode == 2 and "names no method" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_bad_value_touches_no_earlier_results(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    old = out / "results.rank0.jsonl"
    old.write_text('{"kept": true}\n')
    for methods in ("csd:detla=0.5", "csd:delta=2"):
        res = bench(out, methods)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert old.read_text() == '{"kept": true}\n'
    assert "delta must be in [0, 1]" in res.stderr


def test_tree_variants_are_checked_before_the_run(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "b"
    res = subprocess.run([sys.executable, "-m", "speculaas.cli", "bench", "--model", "tiny",
                          "--prompts", "classes", "--limit", "1", "--seeds", "1",
                          "--methods", "sjd:window=8:tree=3x3x10", "--out", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "needs 14 slots" in res.stderr
    assert not (out / "results.rank0.jsonl").exists()
