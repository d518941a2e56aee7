#!/bin/bash
# One prepared GPU round for decoding (issue 66, item 3): the Elman row, then scripts/bench_decode.py on the GPU for
# every cell at batch 1 and 64, contexts 1K to 64K (prefill in 4K segments), 256 tokens decoded, with the time left
# of a 15-minute lease as its bound (cells in the order below; the ones not reached are left for the next lease).
# Results go to $OUT: decode_gpu.csv and decode_gpu.png (the table is printed).
#   bash scripts/gpu_decode.sh             # a 15-minute lease (BUDGET=780 seconds of it)
#   SMALL=1 bash scripts/gpu_decode.sh     # tiny sizes: checks the script on a CPU in a minute or two
source "$(dirname "$0")/gpu_env.sh"
export JAX_PLATFORMS=${JAX_PLATFORMS:-}  # bench_decode.py defaults to the CPU; here the GPU

log "1. Elman H=100 row"
elman_row

log "2. decode: every cell, batch 1 and 64, contexts 1K-64K"
used=$(( $(date +%s) - t0 )); budget=${BUDGET:-780}
args=(--batches 1 64 --contexts 1024 4096 16384 65536 --decode 256 --max-prefill-tokens 4194304)
[ "$small" = 1 ] && args=(--cells gru mamba "attention model.window=8" --batches 1 2 --contexts 16 64 --decode 4 --hidden 8 --vocab 5)
timeout $(( budget - used - 20 )) python3 scripts/bench_decode.py "${args[@]}" --out "$OUT/decode_gpu.csv" --plot "$OUT/decode_gpu.png"
log done
