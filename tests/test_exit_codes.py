"""What ended a run, mapped to its exit code and one line (rnnlab.exit_codes.of_error), as train.py and the
population launcher report it: each error class declares its code; a failing disk is 74; anything else a bug."""

import pytest

from rnnlab import exit_codes
from rnnlab.checkpoint import CheckpointError, CheckpointSaveError
from rnnlab.config import ConfigError
from rnnlab.memory import OutOfMemoryError
from rnnlab.report import NonFiniteLossError
from rnnlab.rundir import RunDirBusy, RunDirUnwritable


@pytest.mark.parametrize("error, code, line", [
    (ConfigError("key 'steps': got 0, allowed: an integer >= 1"), 2, "key 'steps': got 0, allowed: an integer >= 1"),
    (OutOfMemoryError("out of memory: lower batch_size"), 2, "out of memory: lower batch_size"),
    (RunDirBusy("run dir x is in use by pid 7"), 2, "run dir x is in use by pid 7"),
    (CheckpointError("no checkpoint could be restored\nsecond line"), 2, "no checkpoint could be restored"),
    (NonFiniteLossError("loss is nan at step 12", 12), 3, "loss is nan at step 12"),
    (CheckpointSaveError("cannot save step 6: disk full"), 74, "cannot save step 6: disk full"),
    (PermissionError(13, "Permission denied"), 74, "cannot write the run dir (PermissionError: [Errno 13] Permission denied)"),
    (RunDirUnwritable("x is not writable"), 74, "cannot write the run dir (RunDirUnwritable: x is not writable)"),
    (ValueError("shapes (2, 3) and (4,) do not match\n  at ..."), 1, "ValueError: shapes (2, 3) and (4,) do not match"),
    (RuntimeError(), 1, "RuntimeError: "),
])
def test_an_error_maps_to_its_exit_code_and_first_line(error, code, line):
    assert exit_codes.of_error(error) == (code, line)

