"""The persistent compilation cache: the jobs of an lr-and-seed grid compile the train step once, a cache
that a process died reading is moved aside before the next run compiles through it, and an entry that cannot be
read is moved aside and written afresh."""

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, TINY, run_train, train_env
from rnnlab import compile_cache


def _results(workdir):
    return json.loads((workdir / "results.json").read_text())


@pytest.mark.slow("end-to-end")
def test_two_runs_of_one_cell_with_other_lr_and_seed_compile_the_train_step_once(tmp_path):
    cache = tmp_path / "cache"
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           compile_cache.OFF_ENV: "1"}
    runs = {"first": ["optimizer.lr=1e-3", "seed=0"], "second": ["optimizer.lr=3e-3", "seed=1"]}
    for name, args in runs.items():
        proc = run_train([*TINY, "model=gru", *args, f"hydra.run.dir={tmp_path / name}"], tmp_path, env)
        assert proc.returncode == 0, proc.stderr
    first, second = _results(tmp_path / "first"), _results(tmp_path / "second")
    assert first["compile_cache"] == "miss" and second["compile_cache"] == "hit"
    # Both trained, each with its own lr and data: the lr is an input of the one program, not its constant.
    assert first["train_loss"] != second["train_loss"]
    assert "(cache hit)" in (tmp_path / "second" / "train.log").read_text()


@pytest.mark.slow("end-to-end")
def test_a_run_with_the_cache_off_says_so(tmp_path):
    proc = run_train([*TINY, "device.compile_cache=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _results(tmp_path / "run")["compile_cache"] == "off"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_cache_that_a_process_died_compiling_through_is_moved_aside(tmp_path, caplog):
    cache = tmp_path / "jax-cache"
    (cache / "entry-cache").parent.mkdir(parents=True)
    (cache / "entry-cache").write_bytes(b"bad entry")
    markers = tmp_path / "jax-cache.in-use"
    markers.mkdir()
    (markers / f"{socket.gethostname()}-{_dead_pid()}").write_text("0")
    with caplog.at_level("WARNING"):
        aside = compile_cache.quarantine_if_crashed(cache)
    assert aside is not None and (aside / "entry-cache").read_bytes() == b"bad entry"
    assert not cache.exists() and not any(markers.iterdir())
    assert "died while compiling" in caplog.text and str(aside) in caplog.text


@pytest.mark.parametrize("marker", ["live", "other host"])
def test_a_cache_in_use_by_a_live_process_or_another_host_stays(tmp_path, marker):
    import os

    cache = tmp_path / "jax-cache"
    cache.mkdir()
    markers = tmp_path / "jax-cache.in-use"
    markers.mkdir()
    name = f"{socket.gethostname()}-{os.getpid()}" if marker == "live" else f"elsewhere-{_dead_pid()}"
    (markers / name).write_text("0")
    assert compile_cache.quarantine_if_crashed(cache) is None
    assert cache.exists() and (markers / name).exists()


@pytest.mark.slow("end-to-end")
def test_a_run_moves_a_crashed_cache_aside_and_completes(tmp_path):
    """End to end, with the guard on (the suite turns it off for its own cache): a marker left by a process that died
    compiling makes the next run move the cache aside, say where in one line, and train as usual."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "bad-cache").write_bytes(b"not an executable")
    markers = tmp_path / "cache.in-use"
    markers.mkdir()
    (markers / f"{socket.gethostname()}-{_dead_pid()}").write_text("0")
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), compile_cache.GUARD_ENV: "1", compile_cache.OFF_ENV: "1"}
    proc = run_train([*TINY, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("cache.crashed-")]
    assert len(aside) == 1 and (aside[0] / "bad-cache").exists()
    assert f"moved it to {aside[0]}" in proc.stderr + proc.stdout
    assert _results(tmp_path / "run")["status"] == "completed" and not any(markers.iterdir())


UNREADABLE_ENTRIES = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import jax, jax.numpy as jnp
    from rnnlab import compile_cache

    use = compile_cache.enable(True)

    def compile_once():  # (hits, requests) of one compilation through the persistent cache
        jax.clear_caches()
        hits, requests = use.hits, use.requests
        jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((8, 8))).block_until_ready()
        return use.hits - hits, use.requests - requests

    first = compile_once()
    entries = sorted(Path(sys.argv[1]).glob("*-cache"))
    for entry in entries:  # truncated, as a full disk or a killed writer leaves them
        entry.write_bytes(entry.read_bytes()[:len(entry.read_bytes()) // 2])
    print(json.dumps({"first": first, "truncated": compile_once(), "then": compile_once(), "entries": len(entries)}))
""")


def test_an_entry_that_cannot_be_read_is_moved_aside_and_written_afresh(tmp_path):
    """Issue 72: JAX warns about an unreadable entry and compiles, but never writes it again (it keeps the file), so
    every later run missed; now the entry is moved aside (`<entry>.unreadable`), and the next compilation hits."""
    cache = tmp_path / "cache"
    env = {**train_env(), "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", compile_cache.OFF_ENV: "1"}
    proc = subprocess.run([sys.executable, "-c", UNREADABLE_ENTRIES, str(cache)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    n = counts["entries"]
    assert n >= 1 and counts["first"] == [0, n]
    assert counts["truncated"] == [0, n] and counts["then"] == [n, n]  # compiled afresh once, then hits
    assert len(list(cache.glob("*-cache.unreadable"))) == n and len(list(cache.glob("*-cache"))) == n
    assert "Error reading persistent compilation cache entry" not in proc.stderr
    assert proc.stderr.count("cannot be read") == n
