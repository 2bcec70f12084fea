"""The cost-curve cache under concurrency and odd file systems: a stopped process blocks nobody
for long, reads need no lock, locks never follow symlinks, "off" spellings, stale temp files."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import speculaas as sp
from speculaas.decoding import costs as window


def steady(windows):
    return {w: [0.01 * (1 + w)] * 4 for w in windows}


def tiny():
    return sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(tmp_path))
    return tmp_path / "cost_curves.json"


def lock_of(model, tag, batch=1, cfg=False):
    import hashlib

    digest = hashlib.sha1(window._curve_key(model, batch, cfg, tag).encode()).hexdigest()[:16]
    return window.cost_cache_file().with_name(f"cost_curves.{digest}.lock")


def test_a_stopped_measurement_blocks_no_other_setting_and_this_one_briefly(cache, tmp_path,
                                                                          monkeypatch):
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, pathlib, speculaas as sp
        from speculaas.decoding import costs as window
        def stuck(ws):
            pathlib.Path({str(ready)!r}).write_text("x")
            time.sleep(600)
        window.cost_curve(sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0), 1, False,
                          "held", (1, 4), stuck)
        """)], env={**os.environ, "SPECULAAS_CACHE_DIR": str(tmp_path)})
    try:
        deadline = time.time() + 30
        while not ready.exists():
            assert time.time() < deadline and child.poll() is None
            time.sleep(0.05)
        t0 = time.time()
        assert window.cost_curve(tiny(), 1, False, "other", (1,), steady) == {1: 0.02}
        assert time.time() - t0 < 5  # another key: its own lock
        monkeypatch.setattr(window, "LOCK_WAIT_S", 1.0)
        t0 = time.time()
        assert window.cost_curve(tiny(), 1, False, "held", (1, 4), steady) == {1: 0.02, 4: 0.05}
        assert time.time() - t0 < 10  # the same key: a bounded wait, then this process alone
    finally:
        child.kill()
        child.wait()


def test_a_stored_curve_is_read_without_the_lock(cache):
    model = tiny()
    window.cost_curve(model, 1, False, "t", (1, 4), steady)
    lock = lock_of(model, "t")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # a lock that cannot be opened, as in a read-only folder

    def never(ws):
        raise AssertionError("measured again")

    assert window.cost_curve(tiny(), 1, False, "t", (1, 4), never) == {1: 0.02, 4: 0.05}


def test_locks_never_follow_symlinks(cache, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    model = tiny()
    for name, lock in (("a", lock_of(model, "t")), ("b", cache.with_suffix(".lock"))):
        lock.symlink_to(outside / name)
    assert window.cost_curve(model, 1, False, "t", (1,), steady) == {1: 0.02}
    assert list(outside.iterdir()) == []
    assert "could not lock" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["off", "OFF", "none", "None", "0", "false", "no"])
def test_off_spellings_keep_curves_in_memory(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECULAAS_CACHE_DIR", value)
    assert window.cost_cache_file() is None
    window.cost_curve(tiny(), 1, False, "t", (1,), steady)
    assert list(tmp_path.iterdir()) == []


def test_temp_files_of_a_killed_writer_are_cleared_on_the_next_write(cache):
    stale = cache.with_name(f".{cache.name}.k1ll3d.tmp")
    stale.write_text("{half")
    window.cost_curve(tiny(), 1, False, "t", (1,), steady)
    assert not stale.exists() and json.loads(cache.read_text())


def test_a_cache_that_cannot_be_written_is_not_said_to_hold_the_curve(tmp_path, monkeypatch,
                                                                     capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the cache folder should be
    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(blocker / "cache"))
    assert window.cost_curve(tiny(), 1, False, "t", (1,), steady) == {1: 0.02}
    said = capsys.readouterr().err
    assert "memory only (the cache cannot be written)" in said and "cached in " + str(
        blocker) not in said
