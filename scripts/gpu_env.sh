# Sourced by the GPU rounds (scripts/gpu_round.sh, scripts/gpu_zoo_hybrid.sh): $OUT, Hydra's and tensorboardX's
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
