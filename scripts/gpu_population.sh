#!/bin/bash
# One prepared device check for the population launcher (issue 67): the Elman row, then zoo_mqar's lr-and-seed grid
# (4 lrs x 3 seeds, 8 pairs) of a few cells as one program each (hydra/launcher=population) against separate processes
# sharing the GPU (hydra/launcher=parallel, 16 at a time): wall seconds, steps/s per member and in all, compiles, peak
# RSS and the GPU's peak memory (scripts/bench_population.py). Then the state-tracking GPU rows with the population
# launcher: S5 for the cells the papers disagree on, each setting's whole lr x seed grid as one program.
# Wheels for a GPU Python without Hydra: as scripts/gpu_round.sh (.whl/). Results go to $OUT.
#   bash scripts/gpu_population.sh             # a 15-minute lease (about 11 minutes of work)
#   SMALL=1 bash scripts/gpu_population.sh     # tiny sizes: checks the script on a CPU in a few minutes
source "$(dirname "$0")/gpu_env.sh"

log "1. Elman H=100 row"
elman_row

log "2. zoo_mqar's grid: population against separate processes"
if [ "$small" = 1 ]; then
  args=(--toy --cells gru --lrs 1e-3 3e-3 --seeds 1 --launchers population basic)
else
  args=(--cells gru deltanet mamba2 --steps 1000 --launchers population parallel)
fi
timeout 360 python3 scripts/bench_population.py "${args[@]}" --out /tmp/bench_population --json "$OUT/population.json" \
  2>&1 | tee "$OUT/population.md"

log "3. S5 (8,000 steps) with the population launcher: each setting's lr x seed grid as one program, to the deadline"
# The grid {1e-3, 3e-3} x seeds 0-2 holds the protocol's jobs (scripts/results.py chooses the lr on seed 0); a setting
# stopped at the deadline saved every member (exit 75): the same command, on the next lease, resumes it.
steps=8000; [ "$small" = 1 ] && steps=20
for cell in "lstm" "deltaproduct model.num_householder=3 model.allow_neg_eigval=true"; do
  left=$(( ${BUDGET:-780} - ($(date +%s) - t0) - 30 )); [ "$small" = 1 ] && left=300
  [ $left -lt 60 ] && { log "no time left for $cell"; continue; }
  set -- $cell
  timeout -s TERM $left python3 train.py -m experiment=zoo_state_tracking state_tracking=s5 model=$1 "${@:2}" \
    optimizer.lr=1e-3,3e-3 seed=0,1,2 steps=$steps hydra/launcher=population checkpoint.every=1000 \
    hydra.sweep.dir=/tmp/st_pop/s5_$(echo "$cell" | tr ' =' '_-') $([ "$small" = 1 ] && echo hidden_dim=16 eval_every=10 log_every=10) \
    2>&1 | tail -2
done
tar czf "$OUT/state_tracking_population.tgz" -C /tmp/st_pop . 2>/dev/null
log done
