#!/bin/bash
# One prepared GPU round for the state-tracking protocol's GPU rows (issue 65, item 3): the Elman row, then modular
# arithmetic, A5 and S5 at 8,000 steps under the protocol (scripts/zoo_queue.py: each setting's lr grid {1e-3, 3e-3}
# on seed 0, then seeds 1 and 2 at the chosen lr, jobs side by side on the one GPU, each lr and seed of a setting
# loading the first one's compiled step from the persistent cache), stopped cleanly at a deadline. The settings run in
# the order below, the ones the papers disagree on first (Merrill et al.'s LSTM, Siems et al.'s DeltaProduct n_h = 3,
# Grazzi et al.'s switch on Mamba and DeltaNet, Beck et al.'s sLSTM): what a 15-minute lease does not reach is left
# for the next. The jobs are separate processes (scripts/gpu_population.sh runs S5 with the population launcher).
# Wheels for a GPU Python without Hydra: as scripts/gpu_round.sh (.whl/). Results go to $OUT.
#   bash scripts/gpu_state_tracking.sh             # a 15-minute lease (BUDGET=780 seconds of it)
#   SMALL=1 bash scripts/gpu_state_tracking.sh     # tiny sizes: checks the script on a CPU in a few minutes
source "$(dirname "$0")/gpu_env.sh"

log "1. Elman H=100 row"
elman_row

log "2. modular arithmetic, A5 and S5 under the protocol, 8,000 steps"
used=$(( $(date +%s) - t0 )); budget=${BUDGET:-780}
deadline=$(( budget - used - 25 )); [ "$small" = 1 ] && deadline=240
cells=("lstm" "deltaproduct model.num_householder=3 model.allow_neg_eigval=true"
       "mamba model.allow_neg_eigval=true" "deltanet model.allow_neg_eigval=true" "slstm"
       "deltaproduct model.num_householder=3 model.allow_neg_eigval=false" "mamba model.allow_neg_eigval=false"
       "deltanet model.allow_neg_eigval=false" "deltaproduct model.allow_neg_eigval=true" "mlstm"
       "gated_deltanet model.allow_neg_eigval=true" "rwkv7 model.allow_neg_eigval=true" "mamba2 model.allow_neg_eigval=true")
tasks="modular_arithmetic a5 s5"
[ "$small" = 1 ] && cells=("lstm" "deltanet model.allow_neg_eigval=true") && tasks="s5"
settings=()
for task in $tasks; do
  for c in "${cells[@]}"; do
    set -- $c
    settings+=(--setting "experiment=zoo_state_tracking state_tracking=$task model=$1 ${*:2}")
  done
done
extra=(steps=8000); [ "$small" = 1 ] && extra=(steps=20 eval_every=10 log_every=10 hidden_dim=16)
python3 scripts/zoo_queue.py --out /tmp/zq_st --parallel ${PARALLEL:-16} --lrs 1e-3 3e-3 --deadline $deadline --grace 15 \
  "${settings[@]}" -- "${extra[@]}" 2>&1 | grep -E "setting|deadline|done|failed|diverged"
tar czf "$OUT/zoo_state_tracking_gpu.tgz" -C /tmp/zq_st --exclude=checkpoints .
log done
