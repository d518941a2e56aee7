"""`python -m rnnlab.zoo` as a user types it (rnnlab/zoo/__main__.py): the four commands, and bad input refused with
exit 2 in one line before anything runs. The commands themselves: tests/zoo/test_runner.py and test_records.py in
process, tests/zoo/test_end_to_end.py with the real train.py (full tier)."""

import subprocess
import sys


def zoo(*args, cwd):
    return subprocess.run([sys.executable, "-m", "rnnlab.zoo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_module_runs_the_zoos_command_line(tmp_path):
    shown = zoo("--help", cwd=tmp_path)
    assert shown.returncode == 0 and "{plan,run,collect,page}" in shown.stdout
    refused = zoo("plan", "core", "--parallel", "0", cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("argument --parallel: got '0', allowed: an integer >= 1")
    assert not any(tmp_path.iterdir())  # nothing written
