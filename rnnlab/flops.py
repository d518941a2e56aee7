"""FLOPs of a training step (analytic and as JAX/XLA see them), the device's peak, MFU.

What is counted: **matrix multiplications only**, 2 FLOPs per multiply-add, for the
model FLOPs of one forward + backward pass (the convention behind MFU: PaLM, Chowdhery
et al. 2022, App. B), as the step computes them. With `B` batch, `T` time steps (the
task's `total_len`), `I` inputs, `H` hidden units, `L` layers, `O` outputs, `G` the
cell's gate count (its input term is G*H wide) and `R` the matmul FLOPs of one cell step
(`Cell.recurrent_flops`: 2 * H * G*H for h_{t-1} W_hh), one example and one time step
cost, forward:

    first layer input  2 * I * G*H           x (P W_xh): the input projection P [I, H] folded
                                             into layer 0's W_xh (rnnlab.models.folds_projection)
    per layer          R                     the cell's step, inside the time scan (0 for a cell
                                             linear in its state)
                       + the cell's own      `Cell.mixing_flops` per sequence, over T (the LRU's
                                             Re(h C): 4 H^2 T; matrix-state cells' and attention's
                                             maps, scores and chunk products)
                       + 2 * M * H * W       `model.block=residual`: its MLP's M matmuls of [H, W]
                                             (`rnnlab.blocks`: M = 2 gelu, 3 gated, 0 none)
    layers 1 .. L-1    2 * H * G*H           x W_xh (before the scan or inside it: same count)
    readout            2 * H * O             applied at every time step

Backward: every matmul `Y = X W` costs two more of its size (dX = dY W^T and
dW = X^T dY), except where X is data (no dX): the first layer's input term,

    backward = 2 * forward - 2 * I * G*H

per token. Once per step, not per token: the fold's products `P W_xh` (2 * I * H * G*H)
and `c W_xh` (2 * H * G*H, c the projection's bias), forward, and twice that backward
(their gradients for P, c and W_xh). Where the fold is not cheaper (I >= 2H), or the first
layer needs the projected input itself (a residual block, the LRU, the RG-LRU:
`models.folds_first_layer`), the projection runs as its own matmul instead: `2 * I * H` forward and backward
per token, plus the first layer's `2 * H * G*H` like the others. A step is the per-token
count times `B * T` (global batch) plus the per-step terms.

Token ids (the symbol tasks' inputs, `Task.token_inputs`): embedding them is a gather of rows,
which is no matmul and costs nothing here, forward or backward (a scatter-add). Folded, the
first layer's input term is that gather (0 per token) and the per-step products are as above;
not folded (`models.folds_projection`: where I + 1 >= the ids of one device's step, or the
first layer needs x P + c), the projection costs 0 and the first layer's `2 * H * G*H` input
matmul has its full backward (its dx feeds P's gradient): nothing is data, backward = 2 * forward.

This is exact: `jaxpr_matmul_flops` counts the `dot_general`s of the traced step (scan bodies times
their length) and tests/test_flops.py checks the two agree for every cell and option.

Not counted: elementwise work (bias adds, gate nonlinearities and products, the loss,
dropout) and the optimizer update (O(H) per token and O(1) per parameter against
O(G*H^2) per token for the matmuls); XLA's `cost_analysis()` of the same step, which
counts them, comes out a few percent above this count at H=128. `model.remat=true`
recomputes each step's forward in the backward pass (`StepFlops.recompute`); that is
hardware work, not model FLOPs, and is left out of MFU as the convention asks. The
count does not depend on `model.dtype`, `unroll` or `scan_layers`; the peak does (per
kind: dtype and precision).

A hybrid (`model.pattern`) sums each layer's own cell (its G, R and `mixing_flops` with its
`time_scan`) in the per-layer terms above; its first layer never folds the projection
(`models.folds_first_layer`), so its input costs the unfolded terms.

Peak: `peak_flops(device, kind)` reads the matmul FLOP/s that `python -m rnnlab.peak_flops`
measured for this device kind (cached in `$XDG_CACHE_HOME/rnnlab/peak_flops.json`,
default `~/.cache/rnnlab/`), or measures a quick one (an N=1024 matmul, about a
second) and caches it; a cached peak that is not plausible (`peak_entry_problem`) is
ignored with a warning naming the file, and measured again. A peak is per `PEAK_KINDS`
entry, a dtype and a matmul precision: the model's float32 matmuls run at JAX's default
precision, which is TF32 on NVIDIA GPUs since Ampere (and bf16 passes on TPU), so its MFU
divides by the `float32_default` peak, not the full-float32 one (`model_peak_kind`); on
CPU the two are the same. MFU = model FLOPs per second / (peak x devices); on CPU the simulated
devices share the cores of one process, so their peak is used once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import platform
import reprlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rnnlab import blocks, cpu, files, models
from rnnlab.config import ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Matmul FLOPs of one training step over the global batch."""

    forward: int
    backward: int
    recompute: int = 0  # model.remat: each time step's forward again in the backward pass

    @property
    def model(self) -> int:
        """Model FLOPs (what MFU divides by the step time): forward + backward."""
        return self.forward + self.backward

    @property
    def executed(self) -> int:
        """Matmul FLOPs the device runs, remat recomputation included."""
        return self.model + self.recompute


def step_flops(model: ModelConfig, input_dim: int, output_dim: int, tokens: int, seq_len: int,
               token_inputs: bool = False, devices: int = 1, layer_cells: tuple = ()) -> StepFlops:
    """Matmul FLOPs of a step over `tokens` = global batch x time steps of sequences of `seq_len`
    steps (see the module docstring); `token_inputs`: the inputs are token ids of `input_dim`
    symbols, else `input_dim` floats; `devices`: the data-parallel devices the step is split over
    (each embeds tokens / devices ids, which decides the fold of ids); `layer_cells`: one pattern period's cells
    as the model runs them (`RecurrentModel.layer_cells`, forms resolved for the platform), else the config's."""
    # Each layer's cell: one period of the layer pattern (`ModelConfig.layer_cells`, one cell without a
    # pattern), repeated `groups` times; layer 0 is the period's first.
    specs = layer_cells or model.layer_cells()
    groups = model.num_layers // len(specs)
    h = model.hidden_dim
    layer_cells = [spec.make(h) for spec in specs]
    gh = layer_cells[0].input_width
    matmul = 2 * h * gh  # layer 0's [H, W] input weight applied to one token
    # Per layer and token besides its input term: the cell's recurrent matmul, the residual MLP; per
    # layer and sequence: the cell's other matmuls (`Cell.mixing_flops`, which may depend on the length).
    mlp = blocks.mlp_matmuls(model.mlp) * 2 * h * blocks.mlp_width(model.mlp_expand, h) if model.block == "residual" else 0
    recurrent = groups * sum(cell.recurrent_flops() for cell in layer_cells)  # every layer's, per token
    layers_per_token = recurrent + model.num_layers * mlp
    rest_inputs = groups * sum(2 * h * cell.input_width for cell in layer_cells) - matmul  # layers 1 .. L-1's x W_xh
    sequences = tokens // seq_len
    forms = [cell.resolve_time_scan(spec.time_scan, seq_len) for cell, spec in zip(layer_cells, specs)]
    mixing = groups * sum(cell.mixing_flops(seq_len, form) for cell, form in zip(layer_cells, forms)) * sequences
    readout = 2 * h * output_dim
    if models.folds_first_layer(model, input_dim, tokens // devices if token_inputs else None):
        # x (P W_xh): its input is data, no dX; for token ids a gather, no matmul at all.
        first_input = data_input = 0 if token_inputs else 2 * input_dim * gh
        projection = 0
        fold = 2 * input_dim * h * gh + matmul  # P W_xh and c W_xh, once per step
        per_step_forward, per_step_backward = fold, 2 * fold
    else:
        first_input = matmul  # x_1 W_xh of layer 0, after x_1 = x P + c (token ids: a gather of P's rows)
        projection = data_input = 0 if token_inputs else 2 * input_dim * h
        per_step_forward = per_step_backward = 0
    forward = projection + first_input + layers_per_token + rest_inputs + readout
    backward = 2 * forward - data_input
    # Remat reruns the scanned step: the cell's step and the input matmul (inside the scan on the autodiff path).
    recompute = recurrent + first_input + rest_inputs if model.remat else 0
    recompute_mixing = groups * sum(cell.mixing_recompute_flops(seq_len, form)
                                    for cell, form in zip(layer_cells, forms)) * sequences
    return StepFlops(forward * tokens + mixing + per_step_forward, backward * tokens + 2 * mixing + per_step_backward,
                     recompute * tokens + recompute_mixing)


def train_step_flops(model: ModelConfig, input_dim: int, output_dim: int, tokens_per_step: int, seq_len: int,
                     token_inputs: bool = False, devices: int = 1, layer_cells: tuple = ()) -> int:
    """Model FLOPs of one forward + backward pass over `tokens_per_step` = global batch x `seq_len`
    (`step_flops`' arguments)."""
    return step_flops(model, input_dim, output_dim, tokens_per_step, seq_len, token_inputs, devices, layer_cells).model


# --- FLOPs as JAX and XLA see them (for cross-checks and the benchmark) ---------------------------


def _subjaxprs(value: Any) -> list:
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # ClosedJaxpr
        return [value.jaxpr]
    if type(value).__name__ == "Jaxpr":
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _subjaxprs(v)]
    return []


def _jaxpr_matmul_flops(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2 * int(np.prod(out)) * int(np.prod([lhs[d] for d in lhs_contract]))
            continue
        inner = [_jaxpr_matmul_flops(j) for v in eqn.params.values() for j in _subjaxprs(v)]
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * sum(inner)
        elif eqn.primitive.name == "cond":
            total += max(inner, default=0)
        else:  # pjit, remat, custom_vjp/jvp, ...: the body runs once
            total += sum(inner)
    return total


def jaxpr_matmul_flops(fn: Callable, *args: Any) -> int:
    """FLOPs of every `dot_general` that `fn(*args)` traces to, each scan body times its length."""
    import jax

    return _jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def xla_flops(compiled: Any) -> float:
    """`flops` of a compiled executable's `cost_analysis()` (a loop body is counted once)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per computation
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0))


# --- Device peak and MFU ------------------------------------------------------------------------

QUICK_N = 1024  # matmul size of the quick measurement training does when nothing is cached
# A cached peak outside these FLOP/s is no measurement of a device JAX runs on: at 1e6 the quick
# measurement alone would take half an hour, and 1e18 is hundreds of today's fastest chips.
PEAK_BOUNDS = (1e6, 1e18)
QUICK_FACTOR = 20.0  # how far a cached peak may lie from the quick measurement its entry records

# Peak kinds: (dtype, matmul precision). float32 is full float32 (precision=HIGHEST);
# float32_default is what jnp.matmul does with float32 by default, and so what the model
# runs: TF32 on NVIDIA GPUs since Ampere, bf16 passes on TPU, full float32 on CPU.
PEAK_KINDS = {
    "float32": ("float32", "highest"),
    "float32_default": ("float32", "default"),
    "bfloat16": ("bfloat16", "default"),
}


def model_peak_kind(dtype: str) -> str:
    """The peak kind a model computing in `dtype` (model.dtype) runs its matmuls at."""
    return "float32_default" if dtype == "float32" else dtype


def cache_path() -> Path:
    return files.cache_dir() / "peak_flops.json"


def device_key(device: Any) -> str:
    """A name for the device kind; on CPU the processor model and the count of cores this process
    may use (device_kind is just 'cpu'). The cores, not the host's: a process pinned to one
    (`RNNLAB_PIN_CPU=1`, `taskset`) reaches about half a 2-core host's matmul peak, so it
    needs a peak of its own, and must not cache its own under the whole host's key."""
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}:{cpu.host_cores()} cores"


def load_peaks() -> dict:
    return files.read_json_object(cache_path())


def _read_peaks(path: Path) -> tuple[dict, str | None]:
    """The cache file's object, and what is wrong with the file if it cannot be used (None when it
    can, or does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"unreadable ({e.strerror or e})"
    try:
        value = json.loads(text)
    except ValueError:
        return {}, "not JSON"
    if not isinstance(value, dict):
        return {}, f"not a JSON object but {reprlib.repr(value)}"
    return value, None


def _as_peak(value: Any) -> float | None:
    """`value` as FLOP/s if it is a real number (not a bool) within PEAK_BOUNDS, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return value if math.isfinite(value) and PEAK_BOUNDS[0] <= value <= PEAK_BOUNDS[1] else None


def peak_entry_problem(entry: Any) -> str | None:
    """Why a cached peak entry must not be used, or None if it may.

    A hand-edited or damaged cache must never reach the MFU, and checking an entry against a
    fresh measurement on every run would cost a second a run, so the check is against what
    the entry itself records: `flops_per_sec` must be a number within PEAK_BOUNDS and, where
    the entry has a `quick_flops_per_sec` (the quick measurement it was taken as, which
    `peak_flops` stores with every peak it measures), within QUICK_FACTOR of that, so an edit
    of one figure alone is caught. Entries without one (`python -m rnnlab.peak_flops`'s sweeps, whose
    figure is the measurement the quick one would only approximate) get the bounds alone.
    """
    if not isinstance(entry, dict):
        return f"not an object but {reprlib.repr(entry)}"
    allowed = f"is not a number of FLOP/s in [{PEAK_BOUNDS[0]:g}, {PEAK_BOUNDS[1]:g}]"
    peak = _as_peak(entry.get("flops_per_sec"))
    if peak is None:
        return f"flops_per_sec {reprlib.repr(entry.get('flops_per_sec'))} {allowed}"
    if "quick_flops_per_sec" in entry:
        quick = _as_peak(entry["quick_flops_per_sec"])
        if quick is None:
            return f"quick_flops_per_sec {reprlib.repr(entry['quick_flops_per_sec'])} {allowed}"
        if not 1 / QUICK_FACTOR <= peak / quick <= QUICK_FACTOR:
            return f"flops_per_sec {peak:g} is more than {QUICK_FACTOR:g}x from the quick measurement {quick:g} recorded with it"
    return None


def save_peak(device: Any, kind: str, peak: float, source: str, **extra: Any) -> None:
    """Record `peak` FLOP/s for this device kind and `PEAK_KINDS` kind (atomic write; other entries kept,
    a damaged file or device entry replaced). `extra` goes into the entry (`quick_flops_per_sec`:
    see `peak_entry_problem`)."""
    path = cache_path()
    peaks = load_peaks()
    entry = {"flops_per_sec": peak, "source": source, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}
    key = device_key(device)
    if not isinstance(peaks.get(key), dict):
        peaks[key] = {}
    peaks[key][kind] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(path, peaks)


def measure_matmul_flops(n: int, kind: str, device: Any = None, repeats: int = 10, min_seconds: float = 0.05) -> float:
    """FLOP/s of an [n, n] x [n, n] matmul of a `PEAK_KINDS` kind on `device`: median over
    `repeats` timed runs. Each run calls the compiled matmul enough times to take about
    `min_seconds`, ending on `block_until_ready`.
    """
    import jax
    import jax.numpy as jnp

    device = device or jax.devices()[0]
    dtype, precision = PEAK_KINDS[kind]
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    precision = {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}[precision]
    # Drawn on the host: jax.random here would compile two more programs before a run's first log line.
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(rng.standard_normal((n, n), np.float32).astype(jdtype), device) for _ in range(2))
    def peak_matmul(x, y):  # named: a run's compile log tells it from the run's own programs
        return jnp.matmul(x, y, precision=precision)

    matmul = jax.jit(peak_matmul)
    matmul(a, b).block_until_ready()  # compile
    t0 = time.perf_counter()
    matmul(a, b).block_until_ready()
    calls = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = matmul(a, b)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / calls)
    return 2.0 * n**3 / statistics.median(times)


def peak_flops(device: Any, kind: str = "float32", measure: bool = True) -> float | None:
    """Cached peak matmul FLOP/s of this device kind and `PEAK_KINDS` kind; if none, or none that
    `peak_entry_problem` lets through (each one ignored with a warning), a quick measurement,
    cached in place of the bad ones. On CPU float32_default is float32 (the same matmul)."""
    path = cache_path()
    peaks, damage = _read_peaks(path)
    if damage:
        log.warning("%s is %s: ignored%s", path, damage, ", measuring the peak again and rewriting the file" if measure else "")
    key = device_key(device)
    entries = peaks.get(key, {})
    if not isinstance(entries, dict):
        log.warning("%s: the entry of %s is not an object but %s: ignored", path, key, reprlib.repr(entries))
        entries = {}
    kinds = [kind, "float32"] if kind == "float32_default" and device.platform == "cpu" else [kind]
    bad = []
    for k in kinds:
        if k in entries:
            problem = peak_entry_problem(entries[k])
            if problem is None:
                return float(entries[k]["flops_per_sec"])
            log.warning("%s: ignoring the cached %s peak of %s: %s", path, k, key, problem)
            bad.append(k)
    if not measure:
        return None
    log.info("measuring this device's peak matmul FLOP/s for MFU: about a second, once (cached: %s)", path.name)
    peak = measure_matmul_flops(QUICK_N, kinds[-1], device, repeats=5, min_seconds=0.05)
    try:
        for k in dict.fromkeys([kinds[-1], *bad]):
            save_peak(device, k, peak, source=f"quick N={QUICK_N} (run python -m rnnlab.peak_flops for the full sweep)",
                      n=QUICK_N, quick_flops_per_sec=peak)
    except OSError:
        pass  # a read-only home still gets its MFU, just without the cache
    return peak


def mfu(flops_per_sec: float | None, peak: float | None, devices: list) -> float | None:
    """Model-FLOP utilisation; `peak` is one device's (the host's, on CPU). None where it cannot be
    one: a missing figure, or a result that is not a finite positive number."""
    if not flops_per_sec or not peak:
        return None
    chips = 1 if devices[0].platform == "cpu" else len(devices)
    value = flops_per_sec / (peak * chips)
    if math.isfinite(value) and value > MFU_ABOVE_PEAK:
        if peak not in _warned_peaks:  # once per peak: a peak the run outpaces was measured low (a busy core)
            _warned_peaks.add(peak)
            log.warning("the model's %.3g FLOP/s exceed %.1fx the cached peak of %.3g FLOP/s (%s): that peak was "
                        "measured low, on a busy core; MFU is not reported. Measure it again: python "
                        "python -m rnnlab.peak_flops", flops_per_sec, MFU_ABOVE_PEAK, peak * chips, cache_path())
        return None
    return value if math.isfinite(value) and value > 0 else None


MFU_ABOVE_PEAK = 1.05  # an MFU above this is not a measurement of the model but of a wrong peak
_warned_peaks: set[float] = set()
