"""Time rnnlab's compiled train step against PyTorch and flax.linen.RNN doing the same step.

    python scripts/benchmark.py                                   # every cell x the 4-row grid (long on a CPU)
    python scripts/benchmark.py --cells rnn --rows 0 3 --repeats 3   # a quick subset
    python scripts/benchmark.py --compile-layers 1 4 16           # compile seconds vs num_layers
    python scripts/benchmark.py --rows 0 --variant model.recurrence=autodiff   # custom_vjp vs autodiff
    python scripts/benchmark.py --rows 0 --xla-variant xla_cpu_prefer_vector_width=256   # XLA options, side by side
    python scripts/benchmark.py --cells rnn --rows 0 --loop 2000   # the whole training loop vs its dispatch
    python scripts/benchmark.py --rows 0 --dispatch 1 4 8         # steps per dispatch: what launching a step costs

The main columns time the step as `python train.py` runs it: the training loop's own
compiled dispatch (`steps.make_dispatch`, state donated) with the platform's default
`device.steps_per_dispatch` (8 on CPU: 8 train steps in one `fori_loop` per call; 1 on
GPU/TPU), each step drawing its adding-task batch on the devices, Adam, no clipping
(clip_norm=0 on all sides), time per step = time per call / steps. Beside them,
`1/disp ms` is the bare step, one `train_step` per call under `jax.pmap` on a batch
generated beforehand (on the main columns' device count), with its own ratio to torch.
On CPU rnnlab runs on one simulated device per core (that the batch divides into) and on
each count of `--devices` (default 1), and the main columns show the faster, as train.py
picks with device.num_devices=null (column `dev`); `compile s` is the bare step's compile.
`--override device.steps_per_dispatch=K` (or a `--variant` of it) times another dispatch
size. `--variant OVERRIDES` times rnnlab with other settings (e.g.
`model.recurrence=autodiff`, on the per-core device count) side by side; `--xla-variant
OPTIONS` does the same for XLA debug options (XLA_FLAGS' names, without the dashes), passed to
that one compilation as `compiler_options`, so that flags are compared in one process. The same function
(L recurrent layers on the I-wide input, then Linear(H, O) at every step, MSE on the last
step) and the same forward + backward + Adam update are built, in its fastest formulation,
in `torch.nn.RNN`/`LSTM`/`GRU(I, H, L)` (install the optional extra: `pip install -e ".[bench]"`;
without torch that column is skipped, and the script says so) and in
`flax.linen.RNN` with Flax's built-in `SimpleCell`/`LSTMCell`/`GRUCell` on the raw input.
`limit ms` is the physical limit: the step's model FLOPs at the measured peak.
`--no-onednn` adds the fair torch column with `torch.backends.mkldnn` off; `--as-written` adds a secondary torch column on the model as rnnlab writes it, `Linear(I, H)`
first (rnnlab folds that product into its first layer; torch computes it). Each is
warmed up, then the three are timed in turn within every repeat (so a change in machine
load hits them alike) and the median per-step time is kept. Ratios are the other
framework's step time over rnnlab's: above 1 means rnnlab is faster. GFLOP/s and MFU
use rnnlab's analytic model FLOPs (rnnlab/flops.py) and the peak cached by
python -m rnnlab.peak_flops for float32 at JAX's default matmul precision, which the model
runs at (TF32 on NVIDIA GPUs; full float32 on CPU), measured quickly if none is cached.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rnnlab import config as cfg  # noqa: E402
from rnnlab import cpu, flops, loop, parallel, steps, tasks, trainer  # noqa: E402
from rnnlab.cells import cell_names, get_cell  # noqa: E402
from rnnlab.models import build_model  # noqa: E402

GRID = [  # (hidden H, batch B, time steps T, layers L)
    (100, 32, 100, 1),
    (256, 64, 256, 2),
    (1024, 64, 128, 1),
    (128, 1, 2000, 1),
]
LR = 1e-3


def load() -> float:
    return os.getloadavg()[0]


def setup_torch(torch, threads: int) -> None:
    """torch on `threads` threads, flushing denormals to zero as XLA's CPU code does: gradients that
    decay through long sequences into the denormal range made torch's matmuls 20x slower (H=256,
    T=256). Compare against torch at its best."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def compose(cell: str, h: int, b: int, t: int, layers: int, extra: list[str] = ()) -> cfg.Config:
    """A row's config as `python train.py model=<cell>` composes it (the cell's own model config, so
    the LSTM's `recurrence=auto`), with the benchmark's task and optimizer."""
    return compose_overrides([
        f"model={cell}", f"hidden_dim={h}", f"batch_size={b}", f"num_layers={layers}", "data=adding",
        f"data.seq_len={t}", "optimizer=adam", f"optimizer.lr={LR}", "optimizer.clip_norm=0",
        "optimizer.schedule=constant", "optimizer.warmup_steps=0", "device.num_devices=1", *extra,
    ])


def compose_overrides(overrides: list[str]) -> cfg.Config:
    """conf/ composed by Hydra with `overrides`, as `python train.py OVERRIDES` would, validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return cfg.from_omegaconf(hydra_compose(config_name="config", overrides=list(overrides)))


def replicated_state(config: cfg.Config, task: tasks.Task, devices: list, population: bool = False) -> tuple:
    """(the initial train state replicated on `devices`, the learning-rate schedule), as train.py
    builds them (optimizer schedule over 1000 steps); `population`: as a population of one, the state train.py
    trains (`steps.PopulationState`)."""
    model = build_model(config.model, task.output_dim, input_dim=task.input_dim)
    tx, schedule = steps.make_optimizer(config.optimizer, 1000)
    example = task.example_inputs(config.batch_size // len(devices))
    carry = config.batch_size if steps.carries_state(task) else 0  # data=text: the streams' state, as train.py keeps it
    state = steps.create_train_state(jax.random.key(0), model, example, tx, carry_batch=carry)
    return parallel.replicate(steps.PopulationState.stack([state]) if population else state, devices), schedule


class RnnlabStep:
    """rnnlab's pmapped train step on `num_devices` devices, as the training loop builds it."""

    def __init__(self, config: cfg.Config, num_devices: int = 1):
        self.task = tasks.make_task(config.data)
        self.devices = jax.devices()[:num_devices]
        self.state, schedule = replicated_state(config, self.task, self.devices)
        per_device = config.batch_size // num_devices
        sampler = steps.pmap_sampler(self.task, tasks.stream_key(0, 0), per_device, self.devices)
        self.batch = sampler(np.zeros(num_devices, np.int32))  # leaves [num_devices, B / num_devices, ...]
        self.p_step = jax.pmap(
            lambda s, b: steps.train_step(s, b, self.task, schedule),
            axis_name=parallel.AXIS, devices=self.devices, donate_argnums=(0,),
        )
        t0 = time.perf_counter()
        self.p_step = self.p_step.lower(self.state, self.batch).compile()
        self.compile_seconds = time.perf_counter() - t0

    def global_batch(self) -> tasks.Batch:
        """The whole batch (every device's shard, in order) as host arrays [B, ...]: what torch and
        flax get, so that all frameworks do the same work whatever rnnlab's device count."""
        return jax.tree_util.tree_map(lambda x: np.asarray(x).reshape(-1, *x.shape[2:]), self.batch)

    def __call__(self, n: int) -> None:
        for i in range(n):
            self.state, metrics = self.p_step(self.state, self.batch)
            if (i + 1) % loop.MAX_STEPS_IN_FLIGHT == 0:  # as the training loop does: pmap over
                jax.block_until_ready(metrics)  # simulated CPU devices aborts with too many in flight
        jax.block_until_ready((self.state, metrics))


class CompilerOptionsPmap(parallel.DataParallel):
    """pmap compiled with XLA `compiler_options` (debug options by name, as XLA_FLAGS sets them
    for the whole process), for functions called with one argument signature."""

    def __init__(self, devices: list, options: dict):
        super().__init__(devices, "pmap")
        self.options = options

    def map(self, fn, in_layouts, out_layouts, donate_argnums=()):
        mapped = super().map(fn, in_layouts, out_layouts, donate_argnums)
        compiled = []

        def call(*args):
            if not compiled:
                compiled.append(mapped.lower(*args).compile(compiler_options=self.options))
            return compiled[0](*args)

        return call


def parse_xla_options(text: str) -> dict:
    """'name=value ...' (XLA_FLAGS' syntax, leading dashes optional) -> compiler_options: true/false
    as bools, integers as ints, other values as strings, a bare name as true."""
    def value(v: str):
        return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)

    items = (token.lstrip("-").partition("=") for token in text.split())
    return {name: value(v) if sep else True for name, sep, v in items}


class LoopDispatch:
    """The training loop's compiled dispatch (`steps.make_dispatch`) on `num_devices` devices:
    `steps_per_dispatch` train steps per call, each drawing its batch on the devices, metrics
    stacked, state donated. With the platform's default count this is the step as train.py
    runs it. Called with a step count that is a multiple of `steps_per_dispatch`."""

    def __init__(self, config: cfg.Config, num_devices: int, steps_per_dispatch: int | None = None,
                 compiler_options: dict | None = None):
        """steps_per_dispatch: None takes config's `device.steps_per_dispatch`, or the platform's default.
        compiler_options: XLA options for this dispatch's compilation (`CompilerOptionsPmap`)."""
        platform = jax.devices()[0].platform
        self.k = steps_per_dispatch or config.device.steps_per_dispatch or steps.default_steps_per_dispatch(platform)
        self.task = tasks.make_task(config.data)
        self.devices = jax.devices()[:num_devices]
        self.state, _ = replicated_state(config, self.task, self.devices, population=True)
        if compiler_options:
            dp = CompilerOptionsPmap(self.devices, compiler_options)
        else:
            dp = parallel.DataParallel(self.devices, "pmap")
        self.dispatch = steps.make_dispatch(config, self.task, dp, config.batch_size // num_devices, self.k,
                                            steps.Members.population([config]))  # a run: a population of one
        self(self.k)  # compile

    def __call__(self, n: int) -> None:
        assert n % self.k == 0, (n, self.k)
        queued = collections.deque()  # metrics of the dispatches in flight, oldest first
        for _ in range(n // self.k):
            while len(queued) * self.k + self.k > loop.MAX_STEPS_IN_FLIGHT:  # at most 16 steps queued,
                jax.block_until_ready(queued.popleft())  # as in the loop: wait for the oldest only
            self.state, metrics = self.dispatch(self.state, self.k)
            queued.append(metrics)
        jax.block_until_ready(self.state)


class FlaxStep:
    """flax.linen.RNN with Flax's built-in cells, MSE on the last step and Adam, jitted with donation.

    `fair=True` (the main column): the fastest formulation of the function rnnlab trains, the
    first recurrent layer reading the raw inputs (Flax's cells take any input width); False: the
    model as rnnlab writes it, `Dense(I, H)` first, whose product rnnlab folds into its first
    layer's input weights."""

    CELLS = {"rnn": "SimpleCell", "lstm": "LSTMCell", "gru": "GRUCell"}

    def __init__(self, cell: str, h: int, b: int, t: int, layers: int, batch: tasks.Batch, fair: bool = True):
        import flax.linen as nn
        import optax

        cell_cls = getattr(nn, self.CELLS[cell])

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                if not fair:
                    x = nn.Dense(h)(x)
                for _ in range(layers):
                    x = nn.RNN(cell_cls(h))(x)
                return nn.Dense(1)(x)

        inputs, targets = jnp.asarray(batch.inputs), jnp.asarray(batch.targets)
        model = self.model = Model()
        params = jax.jit(model.init)(jax.random.key(0), inputs)
        tx = optax.adam(LR)

        def step(params, opt_state):
            def loss_fn(p):
                return jnp.mean((model.apply(p, inputs)[:, -1, 0] - targets) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.carry = (params, tx.init(params))
        self.step = jax.jit(step, donate_argnums=(0, 1)).lower(*self.carry).compile()

    def __call__(self, n: int) -> None:
        for _ in range(n):
            params, opt_state, self.loss = self.step(*self.carry)  # the loss before the step's update
            self.carry = (params, opt_state)
        jax.block_until_ready(self.carry)


class TorchStep:
    """torch.nn.RNN/LSTM/GRU, a readout Linear, MSE and Adam, on the GPU (cuDNN's RNN kernels)
    when JAX runs on one and torch sees CUDA, else on the CPU (oneDNN's fused RNN primitives,
    left on as torch ships).

    `fair=True` (the main column): `nn.LSTM(I, H, L)` directly on the raw inputs, the fastest
    formulation of the function rnnlab trains; False: as rnnlab writes the model, `Linear(I, H)`
    then `nn.LSTM(H, H, L)`, an extra matmul that rnnlab folds away and torch does not."""

    def __init__(self, cell: str, h: int, b: int, t: int, layers: int, batch: tasks.Batch, fair: bool = True,
                 onednn: bool = True):
        import torch

        self.onednn = onednn  # False: torch.backends.mkldnn off, torch's own (unfused) CPU RNN kernels
        rnn_cls = getattr(torch.nn, get_cell(cell).torch_class)
        torch.manual_seed(0)
        self.torch = torch
        self.cuda = jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
        device = "cuda" if self.cuda else "cpu"
        width = batch.inputs.shape[-1]
        self.inp = None if fair else torch.nn.Linear(width, h, device=device)
        self.rnn = rnn_cls(width if fair else h, h, num_layers=layers, batch_first=True, device=device)
        self.out = torch.nn.Linear(h, 1, device=device)
        params = [*self.rnn.parameters(), *self.out.parameters(), *(self.inp.parameters() if self.inp else ())]
        self.opt = torch.optim.Adam(params, lr=LR)
        self.x = torch.from_numpy(np.asarray(batch.inputs).copy()).to(device)
        self.y = torch.from_numpy(np.asarray(batch.targets).copy()).to(device)

    def __call__(self, n: int) -> None:
        with self.torch.backends.mkldnn.flags(enabled=self.onednn):
            self._steps(n)

    def _steps(self, n: int) -> None:
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            hs, _ = self.rnn(self.x if self.inp is None else self.inp(self.x))
            loss = ((self.out(hs)[:, -1, 0] - self.y) ** 2).mean()
            loss.backward()
            self.opt.step()
        if self.cuda:
            self.torch.cuda.synchronize()


def default_device_count(batch: int) -> int:
    """The most devices train.py tries with device.num_devices=null: on CPU, one simulated device
    per core that the batch divides into (rnnlab.cpu.cpu_device_count); one device elsewhere."""
    if jax.devices()[0].platform != "cpu":
        return 1
    return cpu.cpu_device_count(batch, min(cpu.max_cpu_devices(), len(jax.devices())))


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t0) / n


def bench_row(cell: str, row: tuple, config: cfg.Config, args, peak: float | None, torch_ok: bool) -> dict:
    h, b, t, layers = row
    load_start = load()
    main_devices = default_device_count(b)
    bare = RnnlabStep(config, main_devices)
    runners = {"rnnlab": LoopDispatch(config, main_devices), "bare": bare}
    for n in args.devices:  # the dispatch and the bare step over other device counts, timed side by side
        if b % n == 0 and n != main_devices:
            runners[f"rnnlab@{n}"] = LoopDispatch(config, n)
            runners[f"bare@{n}"] = RnnlabStep(config, n)
    for variant in args.variant:  # the same dispatch with other overrides (its own steps per dispatch), side by side
        runners[variant] = LoopDispatch(compose(cell, h, b, t, layers, [*args.override, *variant.split()]), main_devices)
    for options in args.xla_variant:  # the same dispatch compiled with other XLA options, side by side
        runners[f"xla: {options}"] = LoopDispatch(config, main_devices, compiler_options=parse_xla_options(options))
    if torch_ok and not args.no_torch:
        runners["torch"] = TorchStep(cell, h, b, t, layers, bare.global_batch())
        if args.as_written:
            runners["torch as written"] = TorchStep(cell, h, b, t, layers, bare.global_batch(), fair=False)
        if args.no_onednn:
            runners["torch no oneDNN"] = TorchStep(cell, h, b, t, layers, bare.global_batch(), onednn=False)
    if not args.no_flax:
        runners["flax"] = FlaxStep(cell, h, b, t, layers, bare.global_batch())
    steps = {}
    for name, fn in runners.items():  # warm-up, and how many steps make one timed repeat
        granule = getattr(fn, "k", 1)  # a dispatch runs whole multiples of its k steps
        fn(granule)
        n = max(1, min(200, int(args.min_seconds / max(timed(fn, granule), 1e-6))))
        steps[name] = -(-n // granule) * granule
    times = {name: [] for name in runners}
    for _ in range(args.repeats):  # interleaved, so load changes hit every framework alike
        for name, fn in runners.items():
            times[name].append(timed(fn, steps[name]))
    median = {name: statistics.median(v) for name, v in times.items()}
    by_devices = {main_devices: median["rnnlab"], **{n: median[f"rnnlab@{n}"] for n in args.devices
                                                     if f"rnnlab@{n}" in median}}
    per_core_ms = 1e3 * median["rnnlab"]  # what the variants are compared with (they run on this count)
    main_devices = min(by_devices, key=by_devices.get)  # as train.py does: the faster count
    median["rnnlab"] = by_devices[main_devices]
    median["bare"] = median.get(f"bare@{main_devices}", median["bare"])  # the bare step on the same count
    tokens = b * t
    model_flops = flops.train_step_flops(config.model, bare.task.input_dim, bare.task.output_dim, tokens,
                                         bare.task.total_len, bare.task.token_inputs, main_devices)
    devices = jax.devices()[:main_devices]
    result = {
        "cell": cell, "hidden": h, "batch": b, "time": t, "layers": layers, "overrides": args.override,
        "step_ms": 1e3 * median["rnnlab"], "tokens_per_sec": tokens / median["rnnlab"],
        "gflops_per_sec": model_flops / median["rnnlab"] / 1e9,
        "mfu": flops.mfu(model_flops / median["rnnlab"], peak, devices),
        "compile_seconds": runners.get(f"bare@{main_devices}", bare).compile_seconds, "flops_per_step": model_flops,
        "steps_per_dispatch": runners["rnnlab"].k, "bare_step_ms": 1e3 * median["bare"],
        "torch_step_ms": 1e3 * median["torch"] if "torch" in median else None,
        "flax_step_ms": 1e3 * median["flax"] if "flax" in median else None,
        "vs_torch": median["torch"] / median["rnnlab"] if "torch" in median else None,
        "bare_vs_torch": median["torch"] / median["bare"] if "torch" in median else None,
        "vs_flax": median["flax"] / median["rnnlab"] if "flax" in median else None,
        "torch_as_written_ms": 1e3 * median["torch as written"] if "torch as written" in median else None,
        "vs_torch_as_written": median["torch as written"] / median["rnnlab"] if "torch as written" in median else None,
        "torch_no_onednn_ms": 1e3 * median["torch no oneDNN"] if "torch no oneDNN" in median else None,
        "matmul_limit_ms": 1e3 * model_flops / (peak * (1 if devices[0].platform == "cpu" else len(devices))) if peak else None,
        "devices": main_devices,
        "step_ms_by_devices": {n: 1e3 * by_devices[n] if n in by_devices else None for n in args.devices},
        "step_ms_by_variant": {v: 1e3 * median[v] for v in variant_names(args)},
        "variant_baseline_ms": per_core_ms,
        "repeats": args.repeats, "steps_per_repeat": steps, "all_times_ms": {k: [1e3 * x for x in v] for k, v in times.items()},
        "load_start": load_start, "load_end": load(),
    }
    return result


def variant_names(args) -> list[str]:
    """The side-by-side variants' names: `--variant` override lists, then `--xla-variant` option sets."""
    return [*args.variant, *(f"xla: {options}" for options in args.xla_variant)]


def fmt(x, spec):
    return format(x, spec) if x is not None else "-"


def compile_vs_layers(args) -> list[dict]:
    """Compile seconds of the train step for each num_layers, layer scan vs Python loop."""
    h, b, t, _ = GRID[args.compile_row]
    rows = []
    print(f"compile seconds vs num_layers (H={h}, B={b}, T={t}, cell {args.cells[0]}) | load {load():.2f}")
    for layers in args.compile_layers:
        for scan in (True, False):
            config = compose(args.cells[0], h, b, t, layers, [f"model.scan_layers={str(scan).lower()}", *args.override])
            step = RnnlabStep(config)
            rows.append({"layers": layers, "scan_layers": scan, "compile_seconds": step.compile_seconds, "load": load()})
            print(f"  L={layers:<3} scan_layers={str(scan):<5} compile {step.compile_seconds:6.2f} s | load {load():.2f}", flush=True)
    return rows


def loop_vs_step(args, peak: float | None) -> list[dict]:
    """tokens/s of the whole training loop (train.py's own: on-device data, logging, eval, async
    Orbax saves; its clock skips the compiling step and pauses for eval and saves) against the
    loop's own compiled dispatch at the same steps per dispatch (`LoopDispatch`, the main
    columns), timed right before and after each loop run in the same process; the ratio is the
    loop's median over `--repeats` runs to the dispatch's median. The loop runs with
    device.steps_per_dispatch at the platform's default and at 1, and at the default without
    checkpoints (what Orbax's async saves cost)."""
    import tempfile

    rows = []
    dispatch_sizes = dict.fromkeys([steps.default_steps_per_dispatch(jax.devices()[0].platform), 1])
    print(f"training loop vs its dispatch: {args.loop} steps (fewer beyond {args.loop_seconds:g} s), log_every/eval_every/checkpoint.every at their "
          f"defaults (100/500/500) unless overridden, median of {args.repeats} | load {load():.2f}")
    for cell in args.cells:
        for h, b, t, layers in args.shapes:
            n = default_device_count(b)
            config = compose(cell, h, b, t, layers, [*args.override, f"steps={args.loop}", f"device.num_devices={n}"])
            default = next(iter(dispatch_sizes))
            variants = {f"{k}/dispatch": (k, {"device.steps_per_dispatch": k}) for k in dispatch_sizes}
            variants[f"{default}/dispatch, no checkpoints"] = (default, {"device.steps_per_dispatch": default,
                                                                         "checkpoint.enabled": False})
            row = {"cell": cell, "hidden": h, "batch": b, "time": t, "layers": layers, "devices": n,
                   "dispatch_tokens_per_sec": {}, "loop_tokens_per_sec": {}, "ratio": {}, "loop_wall_seconds": {}}
            for name, (k, overrides) in variants.items():
                bare = LoopDispatch(config, n, k)
                per_step = max(timed(bare, k), 1e-6)
                count = k * max(1, min(200, int(args.min_seconds / per_step / k)))
                # at most --loop steps, fewer where they would take over --loop-seconds (a multiple of 8, >= 64)
                overrides = {**overrides, "steps": max(64, min(args.loop, int(args.loop_seconds / per_step)) // 8 * 8)}
                bare_s, loop_tps, walls = [timed(bare, count)], [], []
                for _ in range(args.repeats):
                    with tempfile.TemporaryDirectory() as workdir:
                        result = trainer.train_and_evaluate(cfg.replace(config, **overrides), workdir)
                    loop_tps.append(result["tokens_per_sec"])
                    walls.append(result["wall_seconds"])
                    bare_s.append(timed(bare, count))
                dispatch = b * t / statistics.median(bare_s)
                row["dispatch_tokens_per_sec"][name] = dispatch
                row["loop_tokens_per_sec"][name] = statistics.median(loop_tps)
                row["ratio"][name] = statistics.median(loop_tps) / dispatch
                row["loop_wall_seconds"][name] = statistics.median(walls)
                row.setdefault("loop_steps", {})[name] = overrides["steps"]
            row["load"] = load()
            rows.append(row)
            print(f"  {cell:<5} H={h:<5} B={b:<3} T={t:<5} L={layers} dev={n} | "
                  + " | ".join(f"{k}: {row['loop_steps'][k]} steps, loop {row['loop_tokens_per_sec'][k]:11,.0f} / dispatch "
                               f"{row['dispatch_tokens_per_sec'][k]:11,.0f} tokens/s = {row['ratio'][k]:.3f}"
                               for k in variants) + f" | load {row['load']:.2f}", flush=True)
    return rows


def dispatch_sizes(args) -> list[dict]:
    """ms per step of the training loop's own compiled dispatch (`LoopDispatch`) at each of
    `args.dispatch` steps per dispatch, on the devices train.py picks first, timed in turn within
    every repeat, with the process's minor page faults and kernel CPU seconds per step (`getrusage`
    around the same repeats: XLA's CPU runtime allocates its temporary buffer afresh per call,
    and the kernel faults it in again each time). Shows what launching one step costs."""
    rows = []
    print(f"steps per dispatch {', '.join(map(str, args.dispatch))}: ms per step, median of {args.repeats} | load {load():.2f}")
    for cell in args.cells:
        for h, b, t, layers in args.shapes:
            n = default_device_count(b)
            config = compose(cell, h, b, t, layers, [*args.override, f"device.num_devices={n}"])
            runners = {k: LoopDispatch(config, n, k) for k in args.dispatch}
            granule = math.lcm(*args.dispatch)  # every repeat runs whole dispatches of every size
            count = max(16, min(400, int(args.min_seconds / max(timed(runners[args.dispatch[0]], granule), 1e-6))))
            count = -(-count // granule) * granule
            times = {k: [] for k in args.dispatch}
            faults = dict.fromkeys(args.dispatch, 0)
            kernel_seconds = dict.fromkeys(args.dispatch, 0.0)
            for _ in range(args.repeats):
                for k, run in runners.items():
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    times[k].append(timed(run, count))
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    faults[k] += (after.ru_minflt - before.ru_minflt) / (count * args.repeats)
                    kernel_seconds[k] += (after.ru_stime - before.ru_stime) / (count * args.repeats)
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            rows.append({"cell": cell, "hidden": h, "batch": b, "time": t, "layers": layers, "devices": n,
                         "ms_per_step": ms, "minor_faults_per_step": faults, "kernel_seconds_per_step": kernel_seconds,
                         "load": load()})
            first = args.dispatch[0]
            print(f"  {cell:<5} H={h:<5} B={b:<3} T={t:<5} L={layers} dev={n} | "
                  + " | ".join(f"{k}/dispatch {v:8.3f} ms ({ms[first] / v:.2f}x; {faults[k]:,.0f} faults, "
                               f"{kernel_seconds[k]:.3f} s kernel a step)" for k, v in ms.items())
                  + f" | load {load():.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=[n for n in cell_names() if get_cell(n).torch_class], choices=cell_names())
    parser.add_argument("--rows", nargs="+", type=int, default=list(range(len(GRID))), help=f"indices into {GRID}")
    parser.add_argument("--shapes", nargs="+", metavar="H,B,T,L", help="time these shapes instead of --rows")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per framework (median kept)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="each repeat runs enough steps to last about this")
    parser.add_argument("--override", nargs="*", default=[], help="extra rnnlab config overrides, e.g. model.unroll=4")
    parser.add_argument("--torch-threads", type=int, default=cpu.host_cores(), help="torch.set_num_threads (default: the cores this process may use)")
    parser.add_argument("--devices", nargs="*", type=int, default=[1],
                        help="other rnnlab device counts timed beside the main column (which uses what train.py "
                             "picks: on CPU one simulated device per core that the batch divides into)")
    parser.add_argument("--variant", nargs="*", default=[],
                        help="rnnlab variants timed beside the main column, each a space-separated override list, "
                             "e.g. --variant model.recurrence=autodiff")
    parser.add_argument("--xla-variant", nargs="*", default=[],
                        help="XLA option sets timed beside the main column, each a space-separated list of "
                             "name=value (XLA_FLAGS names), e.g. --xla-variant xla_cpu_prefer_vector_width=256")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-onednn", action="store_true",
                        help="also time the fair torch column with torch.backends.mkldnn off (CPU), a secondary column")
    parser.add_argument("--as-written", action="store_true",
                        help="also time torch on the model as rnnlab writes it (Linear(I, H) first), a secondary column")
    parser.add_argument("--no-flax", action="store_true")
    parser.add_argument("--loop", type=int, metavar="STEPS",
                        help="instead: tokens/s of the whole training loop (STEPS steps) against its dispatch")
    parser.add_argument("--loop-seconds", type=float, default=8.0,
                        help="with --loop: fewer steps (>= 64) where STEPS would train for longer than this")
    parser.add_argument("--dispatch", nargs="+", type=int, metavar="K",
                        help="instead: ms per step of the loop's own dispatch at K steps per dispatch (e.g. 1 8)")
    parser.add_argument("--compile-layers", nargs="*", type=int, help="only measure compile seconds for these num_layers")
    parser.add_argument("--compile-row", type=int, default=1, help="grid row whose shape --compile-layers uses")
    parser.add_argument("--json", type=Path, default=Path("benchmark.json"), help="where to write the results")
    args = parser.parse_args(argv)
    args.shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else [GRID[i] for i in args.rows]
    if args.xla_variant and (args.compile_layers or args.loop or args.dispatch):
        parser.error("--xla-variant times the step table's rows; it does not apply to --compile-layers, --loop or --dispatch")
    if not all(parse_xla_options(options) for options in args.xla_variant):
        parser.error("--xla-variant: each option set needs at least one name=value")
    cpu.set_cpu_xla_flags()  # as train.py compiles on CPU (before anything starts the backend)

    if args.compile_layers:
        out = {"compile_vs_layers": compile_vs_layers(args)}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        return out

    # Before anything starts the backend: enough simulated CPU devices for train.py's choice and --devices.
    jax.config.update("jax_num_cpu_devices", max([cpu.max_cpu_devices(), *args.devices]))
    try:
        import torch

        setup_torch(torch, args.torch_threads)
        torch_ok, torch_note = True, f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    except ImportError:
        torch_ok, torch_note = False, 'torch not installed: skipping it (pip install -e ".[bench]")'
    device = jax.devices()[0]
    peak = flops.peak_flops(device, flops.model_peak_kind("float32"))
    if args.dispatch:
        out = {"dispatch_sizes": dispatch_sizes(args)}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        return out
    if args.loop:
        out = {"loop_vs_step": loop_vs_step(args, peak)}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        return out
    print(f"device {flops.device_key(device)} | jax {jax.__version__} | {torch_note} | "
          f"float32 (default precision) peak {peak / 1e9:.1f} GFLOP/s | load {load():.2f} | median of {args.repeats}")
    header = (f"{'cell':<5} {'H':>5} {'B':>3} {'T':>5} {'L':>2} {'dev':>3} {'ms/step':>9} {'tokens/s':>10} {'GFLOP/s':>8} "
              f"{'MFU':>6} {'compile s':>9} {'torch ms':>9} {'vs torch':>8} {'flax ms':>9} {'vs flax':>8} "
              f"{'1/disp ms':>9} {'vs torch':>8} {'load':>5}"
              + "".join(f" {f'{n} dev ms':>9} {'main is':>8}" for n in args.devices)
              + (f" {'torch as written ms':>19} {'vs it':>6}" if args.as_written else "")
              + (f" {'no oneDNN ms':>12}" if args.no_onednn else "") + f" {'limit ms':>9}"
              + "".join(f" | {v}: ms, rnnlab (per-core count) is" for v in variant_names(args)))
    print(header)
    # Every config composed (and validated) before anything is timed.
    configs = {(cell, shape): compose(cell, *shape, args.override) for cell in args.cells for shape in args.shapes}
    out = {"device": flops.device_key(device), "jax": jax.__version__, "torch": torch_note,
           "peak_flops_float32_default": peak, "command": " ".join(sys.argv), "results": []}
    for (cell, shape), config in configs.items():
        r = bench_row(cell, shape, config, args, peak, torch_ok)
        out["results"].append(r)
        args.json.write_text(json.dumps(out, indent=2) + "\n")  # after every row: a partial run keeps its rows
        print(f"{cell:<5} {r['hidden']:>5} {r['batch']:>3} {r['time']:>5} {r['layers']:>2} {r['devices']:>3} {r['step_ms']:9.2f} "
              f"{r['tokens_per_sec']:10,.0f} {r['gflops_per_sec']:8.1f} {fmt(r['mfu'], '6.1%')} "
              f"{r['compile_seconds']:9.2f} {fmt(r['torch_step_ms'], '9.2f')} {fmt(r['vs_torch'], '7.2f')}x "
              f"{fmt(r['flax_step_ms'], '9.2f')} {fmt(r['vs_flax'], '7.2f')}x "
              f"{r['bare_step_ms']:9.2f} {fmt(r['bare_vs_torch'], '7.2f')}x {r['load_end']:5.2f}"
              + "".join(f" {fmt(ms, '9.2f')} {fmt(ms and ms / r['step_ms'], '7.2f')}x" for ms in r["step_ms_by_devices"].values())
              + (f" {fmt(r['torch_as_written_ms'], '19.2f')} {fmt(r['vs_torch_as_written'], '5.2f')}x" if args.as_written else "")
              + (f" {fmt(r['torch_no_onednn_ms'], '12.2f')}" if args.no_onednn else "") + f" {fmt(r['matmul_limit_ms'], '9.2f')}"
              + "".join(f" | {ms:9.2f} {ms / r['variant_baseline_ms']:5.2f}x" for ms in r["step_ms_by_variant"].values()),
              flush=True)
    print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
