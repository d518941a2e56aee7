"""The exit codes of every rnnlab command (train.py, the population launcher, the zoo, the corpora, the scripts),
defined once: what a scheduler or a shell script can rely on. `python train.py --help` lists them. `of_error` maps
what ended a run to its code and one line, for train.py and the population launcher alike."""

from __future__ import annotations

OK = 0
BUG = 1  # an unexpected error (traceback in train.log); the zoo: a job ended without a final status
BAD_INPUT = 2  # bad input, refused in one line before any compile
DIVERGED = 3  # a NaN/Inf loss or gradient norm with on_nonfinite=stop
CANNOT_WRITE = 74  # EX_IOERR: a run dir, sweep dir, --out or docs folder that cannot be written
PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal or a deadline, saved; the same command goes on
ABORTED = 130  # a second Ctrl-C (128 + SIGINT)


def of_error(error: BaseException) -> tuple[int, str]:
    """The exit code and the one line for an exception that ended a run (a train.py job, a population's member):
    an error class's own `exit_code` with its message (bad input 2: rnnlab.config.ConfigError and
    rnnlab.checkpoint.CheckpointError; divergence 3: rnnlab.report.NonFiniteLossError; a save that failed 74:
    rnnlab.checkpoint.CheckpointSaveError), an OSError 74 (the run dir cannot be written), anything else a bug, 1.
    The classes declare their codes, so that this module imports nothing of the package."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    code = getattr(type(error), "exit_code", None)
    if code is not None:
        return code, first
    if isinstance(error, OSError):
        return CANNOT_WRITE, f"cannot write the run dir ({type(error).__name__}: {first})"
    return BUG, f"{type(error).__name__}: {first}"
