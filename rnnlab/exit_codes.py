"""The exit codes of every rnnlab command (train.py, the population launcher, the zoo, the corpora, the scripts),
defined once: what a scheduler or a shell script can rely on. `python train.py --help` lists them."""

OK = 0
BUG = 1  # an unexpected error (traceback in train.log); the zoo: a job ended without a final status
BAD_INPUT = 2  # bad input, refused in one line before any compile
DIVERGED = 3  # a NaN/Inf loss or gradient norm with on_nonfinite=stop
CANNOT_WRITE = 74  # EX_IOERR: a run dir, sweep dir, --out or docs folder that cannot be written
PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal or a deadline, saved; the same command goes on
ABORTED = 130  # a second Ctrl-C (128 + SIGINT)
