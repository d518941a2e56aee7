#!/bin/bash
# One prepared device check for the population launcher (issue 67): the Elman row, then zoo_mqar's lr-and-seed grid
# (4 lrs x 3 seeds, 8 pairs) of a few cells as one program each (hydra/launcher=population) against separate processes
# sharing the GPU (hydra/launcher=parallel, 16 at a time): wall seconds, steps/s per member and in all, compiles, peak
# RSS and the GPU's peak memory (scripts/bench_population.py). The zoo itself with the population launcher:
# scripts/gpu_zoo.sh (`python -m rnnlab.zoo run SUITE --executor population`).
# Wheels for a GPU Python without Hydra: as scripts/gpu_round.sh (.whl/). Results go to $OUT.
#   bash scripts/gpu_population.sh             # at most 8 minutes (its timeouts) of a 15-minute lease
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

log done
