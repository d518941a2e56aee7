# Sourced by the GPU rounds (scripts/gpu_round.sh, scripts/gpu_zoo.sh, ...): $OUT, Hydra's and tensorboardX's
# wheels from .whl/ where the GPU's Python lacks them (pip download / pip wheel them here first), unbuffered output,
# JAX allocating on demand (several processes share the GPU), $small (SMALL=1: tiny sizes), `log`, and the versions.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
small=${SMALL:-0}
t0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - t0 ))s) $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>/dev/null
python3 -c "import jax, flax, optax, orbax.checkpoint, hydra; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__)" || exit 1
elman_row() {  # the machine's speed beside a round's figures: the Elman H=100 row's tokens/s
  local steps=400; [ "$small" = 1 ] && steps=40
  timeout 70 python3 train.py model=rnn hidden_dim=100 batch_size=32 data.seq_len=100 steps=$steps log_every=$steps \
    eval_every=100000 checkpoint.every=100000 hydra.run.dir=/tmp/runs/elman 2>&1 | grep -E "tokens/s|Error|error" | tail -2
}
