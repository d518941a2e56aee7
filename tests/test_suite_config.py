"""The test command's own settings (pyproject.toml's pytest addopts): a test that takes its worker
process down once (a segfault) fails the run at once instead of leaving it waiting forever."""

import os
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


@pytest.mark.slow
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
