#!/bin/bash
# One prepared GPU round for the hybrid stacks' mixers (issues 51, 52): the Elman row, cuDNN's flash attention
# against XLA's in bf16 (jax.nn.dot_product_attention alone), RWKV-7's two forms. Its part 4, the hybrid zoo's
# settings, is now the zoo's: `bash scripts/gpu_zoo.sh second` (or one table: `bash scripts/gpu_zoo.sh hybrid_mqar16`).
# Wheels for a GPU Python without Hydra: as scripts/gpu_round.sh (.whl/). Results go to $OUT.
#   bash scripts/gpu_zoo_hybrid.sh                 # at most 5 minutes (its timeouts) on one GPU
#   SMALL=1 bash scripts/gpu_zoo_hybrid.sh         # tiny sizes: checks the script on a CPU in a few minutes
source "$(dirname "$0")/gpu_env.sh"

log "1. Elman H=100 row"
steps=400; [ "$small" = 1 ] && steps=40
timeout 70 python3 train.py model=rnn hidden_dim=100 batch_size=32 data.seq_len=100 steps=$steps log_every=$steps \
  eval_every=100000 checkpoint.every=100000 hydra.run.dir=/tmp/runs/elman 2>&1 | grep -E "tokens/s|Error|error" | tail -2

log "2. attention alone, forward and backward, bf16: XLA against cuDNN, full and window 256"
T=4096; [ "$small" = 1 ] && T=256
timeout 60 python3 - "$T" "$small" <<'PY' 2>&1 | tee "$OUT/attention_cudnn.log"
import statistics, sys, time
import jax, jax.numpy as jnp
T, small = int(sys.argv[1]), sys.argv[2] == "1"
B, N, D = 16, 4, 64  # bench_scans.py's attention row: H=256, 4 heads, batch 16
keys = jax.random.split(jax.random.key(0), 4)
q, k, v, g = (jax.random.normal(key, (B, T, N, D), jnp.bfloat16) for key in keys)
impls = ["xla"] if small else ["xla", "cudnn"]
ref = {}
for window in (None, 256):
    for impl in impls:
        local = {"local_window_size": (window - 1, 0)} if window else {}
        def loss(q, k, v):
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl, **local)
            return jnp.vdot(o.astype(jnp.float32), g.astype(jnp.float32)), o
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        try:
            t = time.perf_counter(); compiled = step.lower(q, k, v).compile(); c = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - report any refusal in one line
            print(f"window={window} {impl}: refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"); continue
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", 0) / 2**20
        (val, o), grads = compiled(q, k, v); jax.block_until_ready(grads)
        times = []
        for _ in range(5):
            t = time.perf_counter(); jax.block_until_ready(compiled(q, k, v)); times.append(time.perf_counter() - t)
        ref.setdefault(window, o.astype(jnp.float32))
        diff = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref[window])))
        print(f"window={window} {impl}: {1e3 * statistics.median(times):.2f} ms fwd+bwd (median of 5), "
              f"compile {c:.1f} s, temp {temp:.0f} MiB, max |o - xla's o| {diff:.3g}")
PY

log "3. RWKV-7: sequential, chunked (chunk 16), and chunk 64 compiled only, T=1024, H=256, B=16, L=2"
T=1024; [ "$small" = 1 ] && T=64
timeout 45 python3 scripts/bench_scans.py --cells rwkv7 --scans sequential --seq-lens $T --repeats 3 \
  --json "$OUT/rwkv7_seq.json" 2>&1 | tail -3
timeout 45 python3 scripts/bench_scans.py --cells rwkv7 --scans chunked --seq-lens $T --repeats 3 \
  --set model.chunk_size=16 --json "$OUT/rwkv7_chunk16.json" 2>&1 | tail -1
[ "${PIPESTATUS[0]}" = 124 ] && echo "chunk 16: no row within 45 s (compile and 3 repeats)"
timeout 40 python3 scripts/bench_scans.py --cells rwkv7 --scans chunked --seq-lens $T --memory-only \
  --json "$OUT/rwkv7_chunk64_compile.json" 2>&1 | tail -1
[ "${PIPESTATUS[0]}" = 124 ] && echo "chunk 64: not compiled within 40 s"

log done
