"""`python -m rnnlab.zoo` end to end with the real train.py (full tier): a tiny suite run by each executor at the
checkout's HEAD (a worktree), killed with SIGKILL mid-job and run again, collected and published; the records carry
the provenance. And the wheel: every subpackage installs."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from rnnlab.zoo import records, runner
from rnnlab.zoo.protocol import Setting, Table

pytestmark = pytest.mark.slow("end-to-end")
ROOT = Path(__file__).resolve().parents[2]
# The edge rule's bound is the grid itself here: which lr wins after 60 steps is not this test's business (the rule's
# own tests use a stand-in train.py), so every run is the same 3 jobs.
TABLE = Table("tiny", "Tiny parity", "zoo_parity", (), (Setting("rnn"),), (1e-3, 3e-3), 2, 60, "accuracy", True, 8,
              (8, 16), "A tiny parity table.", lr_bounds=(1e-3, 3e-3))
EXTRA = ["hidden_dim=8", "batch_size=8", "eval_batches=1", "checkpoint.every=20", "log_every=20", "eval_every=60",
         "device.compile_cache=false"]
SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_end_to_end import TABLE
from rnnlab.zoo import cli
raise SystemExit(cli.main(sys.argv[1:], tables={{"tiny": TABLE}}, suites={{"t": ("tiny",)}}))
"""


def zoo(tmp_path, *args, **popen):
    script = tmp_path / "zoo.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("executor", ["processes", "population"])
def test_a_tiny_suite_runs_is_killed_resumes_and_is_published_with_provenance(tmp_path, executor):
    out, docs = tmp_path / "out", tmp_path / "docs"
    docs.mkdir()  # the zoo writes records into an existing docs folder only, never a stray one where it runs
    args = ["--out", str(out), "--docs", str(docs), "--executor", executor, "--", *EXTRA]
    proc = zoo(tmp_path, "run", "t", *args, popen=True)
    until = time.time() + 300
    while time.time() < until and not list(out.glob("tiny/rnn/*/checkpoints/20")):
        time.sleep(0.2)
    assert list(out.glob("tiny/rnn/*/checkpoints/20")), "no job reached its first checkpoint"
    proc.kill()  # the runner, and then every train.py it started, with SIGKILL
    subprocess.run(["pkill", "-9", "-f", f"hydra.(run|sweep).dir={out}"], check=False)
    proc.wait()
    time.sleep(1.0)
    again = zoo(tmp_path, "run", "t", *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[3/3] 0 running, 0 left, 0 failed, done" in again.stdout
    logs = "".join(p.read_text() for p in out.glob("tiny/rnn/*/train.log"))
    assert "resumed from" in logs  # the killed job went on from its checkpoint
    head = runner.git(ROOT, "rev-parse", "HEAD")
    recs = records.read_table(docs, "tiny")
    assert len(recs) == 3 and {r["status"] for r in recs} == {"completed"}
    for r in recs:
        prov = r["provenance"]
        assert prov["commit"] == head and prov["dirty"] is False
        assert prov["machine"]["platform"] == "cpu" and prov["machine"]["cpu_cores"] == os.cpu_count()
        assert set(prov["versions"]) >= {"jax", "jaxlib", "flax", "optax"} and prov["started_utc"] <= prov["ended_utc"]
        assert set(r["metrics"]) == {"8", "16"} and {"experiment=zoo_parity", "model=rnn"} <= set(r["overrides"])
    # collect rebuilds the same records from the run dirs alone; page publishes them, the same bytes each time.
    (docs / "zoo" / "records" / "tiny.jsonl").unlink()
    assert zoo(tmp_path, "collect", "t", "--out", str(out), "--docs", str(docs)).returncode == 0
    assert sorted(map(json.dumps, records.read_table(docs, "tiny"))) == sorted(map(json.dumps, recs))
    assert zoo(tmp_path, "page", "--docs", str(docs), "--no-plots").returncode == 0
    text = (docs / "results.md").read_text()
    assert f"Commit `{head[:12]}` on CPU" in text and "1 of 1 settings under the protocol" in text
    assert zoo(tmp_path, "page", "--docs", str(docs), "--no-plots").returncode == 0
    assert (docs / "results.md").read_text() == text
    plan = zoo(tmp_path, "plan", "t", "--out", str(out), "--docs", str(docs))
    assert "3 jobs: 3 recorded, 0 ready" in plan.stdout


def test_the_wheel_carries_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel, = (tmp_path / "dist").glob("rnnlab-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # The dependencies from this interpreter's site-packages, after the venv's own, as a plain path (its .pth files,
    # this checkout's editable install among them, are not processed): rnnlab comes from the wheel alone.
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    Path(venv_site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    probe = ("import rnnlab.cells, rnnlab.tasks, rnnlab.zoo.protocol, pathlib; print(rnnlab.zoo.protocol.__file__); "
             "print(pathlib.Path(rnnlab.cells.__file__).parents[1] / "
             "'hydra_plugin_path/hydra_plugins/rnnlab_population_launcher.py')")
    done = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    package, plugin = done.stdout.split()
    assert package.startswith(str(venv)) and Path(plugin).is_file()
