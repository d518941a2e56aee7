#!/bin/bash
# One prepared GPU round: the Elman row, the forms' speed, the forms' equality tests under the GPU's matmul precision
# (docs/benchmarks.md has what it gave on an H100; the zoo on a GPU: scripts/gpu_zoo.sh). On a GPU machine whose
# Python has jax, flax, optax and orbax but not Hydra: put the wheels of hydra-core, omegaconf, antlr4-python3-runtime
# and tensorboardX in .whl/ (pip download / pip wheel), and the script installs them first. Results go to $OUT.
#   bash scripts/gpu_round.sh             # at most 7 minutes (its timeouts) on one GPU
#   SMALL=1 bash scripts/gpu_round.sh     # tiny sizes: checks the script itself on a CPU in a few minutes
source "$(dirname "$0")/gpu_env.sh"

log "1. Elman H=100 row"
steps=400; [ "$small" = 1 ] && steps=40
for i in 1; do
  timeout 70 python3 train.py model=rnn hidden_dim=100 batch_size=32 data.seq_len=100 steps=$steps log_every=$steps \
    eval_every=100000 checkpoint.every=100000 hydra.run.dir=/tmp/runs/elman$i 2>&1 | grep -E "tokens/s|Error|error" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || { log "Elman row failed"; exit 1; }
done

log "2. forms: tokens/s, memory, compile"
T=1024; A=4096; [ "$small" = 1 ] && T=64 && A=256
timeout 150 python3 scripts/bench_scans.py --cells lstm slstm mlstm rwkv7 gated_deltanet deltaproduct mamba2 \
  --seq-lens $T --repeats 3 --json "$OUT/scans.json" 2>&1 | tee "$OUT/scans.log" | grep -v "^$"
timeout 60 python3 scripts/bench_scans.py --cells attention --seq-lens $A --repeats 3 --json "$OUT/attn_full.json" 2>&1 | tail -4
timeout 45 python3 scripts/bench_scans.py --cells attention --seq-lens $A --repeats 3 --scans blockwise \
  --set model.window=256 --json "$OUT/attn_window.json" 2>&1 | tail -3

log "3. the forms' equality tests on the GPU (its default float32 matmul precision)"
timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/cells/test_mlstm.py tests/cells/test_rwkv7.py tests/cells/test_matrix_forms.py \
  2>&1 | tail -15 | tee "$OUT/pytest.log"
log done
