"""The test command's own settings (pyproject.toml's pytest addopts): a test that takes its worker
process down once (a segfault) fails the run at once instead of leaving it waiting forever. CI's: Hypothesis
draws from a fixed seed there (tests/conftest.py's "rnnlab-ci" profile), and .ci/run runs the README's command and keeps
each tier's times."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CRASH_ONCE = '''import os
from pathlib import Path


def test_{i}():
    marker = Path(__file__).with_name("crashed")
    if not marker.exists():
        marker.write_text("")
        os.abort()
'''


@pytest.mark.slow("end-to-end")
def test_a_worker_crash_fails_the_run_and_does_not_hang(tmp_path):
    # Twelve modules (twelve loadscope units), the ninth crashing its worker on the first try: with
    # xdist's replaced worker this layout waits forever (pytest-dev/pytest-xdist#1378).
    for i in range(12):
        text = CRASH_ONCE.format(i=i) if i == 8 else f"import time\n\n\ndef test_{i}():\n    time.sleep(0.3)\n"
        (tmp_path / f"test_{i:02d}.py").write_text(text)
    # The project's addopts (two workers, loadscope) on these files, outside the project's conftest.
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
               "-p", "no:cacheprovider", "-p", "no:faulthandler", "-n", "2", str(tmp_path)]
    # Its own session, so that a hung run's workers go down with it.
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = run.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        pytest.fail("pytest with the project's options still waits 90 s after a worker crashed")
    assert run.returncode == 1, out[-2000:]
    assert "crashed while running 'test_08.py::test_8'" in out, out[-2000:]


# Each @given test of the modules whose draws CI must repeat, and whether it draws from a fixed seed.
DERANDOMIZED = """
import json, sys
sys.path.insert(0, "tests")
import conftest  # noqa: F401  (registers the "rnnlab-ci" profile; with CI set, loads it)
import test_eval_segments, test_fuzz_config
from hypothesis import settings
current = getattr(settings, "get_current_profile_name", None)
profile = current() if current else settings._current_profile
print(json.dumps({"profile": profile} | {
    f"{m.__name__}::{name}": getattr(f, "_hypothesis_internal_use_settings", settings.default).derandomize
    for m in (test_eval_segments, test_fuzz_config) for name, f in vars(m).items()
    if getattr(f, "is_hypothesis_test", False)}))
"""


def test_ci_draws_every_hypothesis_example_from_a_fixed_seed():
    """With CI set (CI services set CI=true), the Hypothesis tests of test_eval_segments and test_fuzz_config run
    derandomized: conftest loads its "rnnlab-ci" profile before the test modules' own @settings are made. Without CI,
    test_eval_segments draws at random (its @settings leave derandomize to the profile)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    drawn = {}
    for ci in (None, "true"):
        run = subprocess.run([sys.executable, "-c", DERANDOMIZED], cwd=ROOT, env=env | ({"CI": ci} if ci else {}),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        drawn[ci] = json.loads(run.stdout.splitlines()[-1])
    assert drawn["true"].pop("profile") == "rnnlab-ci" != drawn[None].pop("profile")
    segments = "test_eval_segments::test_segments_of_an_example_are_the_example"
    assert segments in drawn["true"] and any(name.startswith("test_fuzz_config::") for name in drawn["true"])
    assert all(drawn["true"].values()), drawn["true"]
    assert drawn[None][segments] is False  # so it is the profile that fixes its draws in CI


def test_ci_runs_the_readmes_test_command_and_writes_each_tiers_times_where_git_ignores_them():
    """.ci/run runs `pytest` as the README writes it, then `pytest -m slow`, each with its options (per-test durations,
    a junit XML) through PYTEST_ADDOPTS, the XMLs under a path git ignores."""
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^pytest +# the fast tier", readme, re.M)  # the README's test command
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert "set -euo pipefail" in lines
    runs = [re.fullmatch(r'PYTEST_ADDOPTS="(.*) \$\{PYTEST_ADDOPTS:-\}" (.*)', line)
            for line in lines if "pytest" in line and not line.startswith("pip ")]
    assert all(runs) and [run.group(2) for run in runs] == ["pytest", "pytest -m slow"], lines
    junits = []
    for run in runs:
        options = run.group(1).split()
        assert "--durations=50" in options
        (junit,) = [o.removeprefix("--junitxml=") for o in options if o.startswith("--junitxml=")]
        junits.append(junit)
    assert junits == [".pytest_cache/junit-fast.xml", ".pytest_cache/junit-full.xml"]
    ignored = subprocess.run(["git", "check-ignore", *junits], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ignored.stdout.split() == junits, ignored
