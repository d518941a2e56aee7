#!/bin/bash
# One prepared device round for the zoo: the Elman row, then `python -m rnnlab.zoo run SUITE --executor population`
# to a deadline inside the lease. Each setting's lr grid on seed 0 runs as one program, then its other seeds at the lr
# the protocol chose (rnnlab/zoo/protocol.py), PARALLEL programs side by side on the one GPU. The zoo runs the suite's
# commit from a git worktree of this checkout (so it needs one, .git included) and skips every job that the committed
# records (docs/zoo/records/) already hold for that commit on this kind of device: with this round's records committed,
# the next lease goes on where this one stopped. The run dirs do not outlast the machine: a job stopped at the
# deadline starts again.
# Wheels for a GPU Python without Hydra: as scripts/gpu_round.sh (.whl/). Results go to $OUT: zoo.log,
# zoo_records.tgz (docs/zoo/records/ with this round's records merged in: unpack it over docs/zoo/ here, then
# `python -m rnnlab.zoo page`) and zoo_runs.tgz (the run dirs, without checkpoints).
#   bash scripts/gpu_zoo.sh [SUITE]        # SUITE: core (default), second, or one table; `python -m rnnlab.zoo plan
#                                          # SUITE` lists its jobs. A 15-minute lease (BUDGET=780 seconds of it)
#   SMALL=1 bash scripts/gpu_zoo.sh        # checks the script on a CPU in about 3 minutes: parity's rnn grid at HEAD
#                                          # to a 90 s deadline (exit 75: stopped there), records and run dirs in /tmp
source "$(dirname "$0")/gpu_env.sh"
suite=${1:-core}

log "1. Elman H=100 row"
elman_row

# The zoo gives each job PYTHONPATH=<its worktree>: gpu_env.sh's wheels (on PYTHONPATH) reach the jobs through a .pth.
if [ -n "${PYTHONPATH:-}" ]; then
  python3 - "$PYTHONPATH" <<'PY' || exit 1
import os, site, sys, sysconfig
for folder in (sysconfig.get_paths()["purelib"], site.getusersitepackages()):
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "rnnlab_gpu_wheels.pth"), "w") as f:
            f.write(sys.argv[1].replace(":", "\n") + "\n")
        break
    except OSError:
        continue
else:
    sys.exit("no site-packages folder to write a .pth to")
PY
fi

docs=docs; runs=/tmp/zoo_runs; args=("$suite")
used=$(( $(date +%s) - t0 )); deadline=$(( ${BUDGET:-780} - used - 60 ))  # 60: the grace (15 s) and the copying
if [ "$small" = 1 ]; then  # no committed records: HEAD, and parity's rnn grid from the start
  args=(parity --cell rnn); deadline=90; docs=/tmp/zoo_small_docs; runs=/tmp/zoo_small_runs
fi
log "2. the zoo: ${args[*]} with the population executor, to the deadline (${deadline} s)"
python3 -m rnnlab.zoo run "${args[@]}" --executor population --parallel "${PARALLEL:-4}" --deadline "${deadline}s" \
  --grace 15 --docs "$docs" --out "$runs" 2>&1 | tee "$OUT/zoo.log"
code=${PIPESTATUS[0]}
log "zoo exit $code (0: done; 75: stopped at the deadline, run again; 1: a job ended without a final status; 2: bad input)"
mkdir -p "$docs/zoo/records"
tar czf "$OUT/zoo_records.tgz" -C "$docs/zoo" records
tar czf "$OUT/zoo_runs.tgz" -C "$runs" --exclude=checkpoints --exclude=worktrees . 2>/dev/null
log done
