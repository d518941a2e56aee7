#!/bin/bash
# The state-tracking protocol of issue 65 on a CPU, as fixed there before it ran: experiment=zoo_state_tracking as it
# is (H=64, two layers, batch 64, clip 1.0, each cell in its paper's block, 512 eval sequences per length).
#   S3 (state_tracking=s3): 17 settings, 4,000 steps, the preset's cosine schedule (warm-up 50, end at 0.1 lr), the lr
#   grid {1e-3, 3e-3} on seed 0, chosen on the training length's sequence_accuracy (ties to the smaller lr), then
#   seeds 1 and 2 at the chosen lr: 68 jobs. S3 comes first; then parity's missing rows under zoo_parity's own
#   protocol (10 settings, 60 jobs).
# Two jobs side by side, pinned, checkpoints on: the same command resumes every stopped job where it stopped.
#   bash scripts/state_tracking_protocol.sh [OUT]           # OUT: default /work/zoo_runs/state_tracking
#   python scripts/summarize.py OUT/zoo_state_tracking      # the tables; then docs/zoo_state_tracking.csv
set -u
cd "$(dirname "$0")/.."
OUT=${1:-/work/zoo_runs/state_tracking}
cells=("lstm" "slstm" "mlstm")
for cell in mamba mamba2 deltanet gated_deltanet deltaproduct "deltaproduct model.num_householder=3" rwkv7; do
  for switch in false true; do cells+=("$cell model.allow_neg_eigval=$switch"); done
done
# settings PREFIX CELL...: one --setting per "cell [overrides]", after the overrides PREFIX
settings() { local prefix=$1 c; shift; settings=(); for c in "$@"; do set -- $c; settings+=(--setting "$prefix model=$1 ${*:2}"); done; }
settings "experiment=zoo_state_tracking state_tracking=s3" "${cells[@]}"
RNNLAB_PIN_CPU=1 python scripts/zoo_queue.py --out "$OUT" --parallel "${PARALLEL:-2}" --seeds 3 --lrs 1e-3 3e-3 \
  --deadline "${DEADLINE:-inf}" "${settings[@]}" -- steps=4000 || exit $?
# Parity under zoo_parity's own protocol (its 2,000 steps, its 4-lr grid, 3 seeds): the settings its table lacks.
parity=("mamba model.allow_neg_eigval=true" "deltanet model.allow_neg_eigval=true"
        "gated_deltanet model.allow_neg_eigval=true" "rwkv7 model.allow_neg_eigval=true")
for switch in false true; do
  parity+=("mamba2 model.allow_neg_eigval=$switch" "deltaproduct model.allow_neg_eigval=$switch"
           "deltaproduct model.num_householder=3 model.allow_neg_eigval=$switch")
done
settings "experiment=zoo_parity" "${parity[@]}"
RNNLAB_PIN_CPU=1 python scripts/zoo_queue.py --out "$OUT" --parallel "${PARALLEL:-2}" --seeds 3 \
  --deadline "${DEADLINE:-inf}" "${settings[@]}"
