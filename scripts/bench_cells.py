"""Measure the cells' step times at the zoo's shapes, and model options that are not about step time,
side by side in one process.

    python scripts/bench_cells.py zoo     # ms per train step, x the GRU, model FLOPs x the GRU's, MFU: every cell at
                                          # the three zoo shapes
    python scripts/bench_cells.py flops   # model FLOPs per train step x the GRU's at each zoo shape (counted, no run)
    python scripts/bench_cells.py init    # init + compile time of the stacked layers, scan vs vmap init
    python scripts/bench_cells.py remat   # XLA's peak temp memory of the compiled gradient, remat on vs off

`zoo` trains each setting as train.py does (`rnnlab.trainer.train_and_evaluate` on the composed preset, one
device, no checkpoints; the persistent compilation cache on, so a repeat loads its program), and reads the
steady-state rate from its results.json (compile excluded). First it measures the Elman H=100 row (the
machine's speed: `python train.py model=rnn hidden_dim=100 batch_size=32 data.seq_len=100`).

Times are medians over `--repeats` rounds; within a round the variants run back to back
(alternating), so load from other processes hits them alike. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rnnlab import cpu  # noqa: E402
from rnnlab.config import ConfigError, ModelConfig  # noqa: E402
from rnnlab.models import build_model  # noqa: E402

BASE = ModelConfig(
    cell="rnn", hidden_dim=64, num_layers=1, init="orthogonal", activation="tanh", scan_layers=True,
    stack_init="scan", forget_bias=1.0, recurrence="autodiff", remat=False, dtype="float32", unroll=1, dropout=0.0,
    block="plain", time_scan="sequential",
)


def init_seconds(config: ModelConfig, batch: int, seq_len: int) -> tuple[float, float]:
    """(trace+lower+compile seconds, run seconds) of jit(model.init), caches cleared first."""
    jax.clear_caches()
    model = build_model(config, 1)
    x = jnp.zeros((batch, seq_len, 2))
    key = jax.random.key(0)
    start = time.perf_counter()
    compiled = jax.jit(model.init).lower(key, x).compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(key, x))
    return compiled_at - start, time.perf_counter() - compiled_at


def bench_init(args) -> None:
    print(f"jit(model.init): trace+lower+compile, then run; {args.cells[0]} cell, H={args.hidden}, B={args.batch}, "
          f"T={args.seq_len}; seconds, median of {args.repeats}\n")
    print("| num_layers | scan: compile | scan: run | scan: total | vmap: compile | vmap: run | vmap: total | scan/vmap |")
    print("|---|---|---|---|---|---|---|---|")
    init_seconds(dataclasses.replace(BASE, cell=args.cells[0]), args.batch, args.seq_len)  # warm-up, untimed
    for layers in args.layer_counts:
        results = {"scan": [], "vmap": []}
        for _ in range(args.repeats):
            for how in results:
                config = dataclasses.replace(BASE, cell=args.cells[0], hidden_dim=args.hidden, num_layers=layers, stack_init=how)
                results[how].append(init_seconds(config, args.batch, args.seq_len))
        med = {how: [statistics.median(r[i] for r in runs) for i in (0, 1)] for how, runs in results.items()}
        totals = {how: statistics.median(sum(r) for r in runs) for how, runs in results.items()}
        print(f"| {layers} | {med['scan'][0]:.3f} | {med['scan'][1]:.3f} | {totals['scan']:.3f} | {med['vmap'][0]:.3f} | "
              f"{med['vmap'][1]:.3f} | {totals['vmap']:.3f} | {totals['scan'] / totals['vmap']:.2f}x |", flush=True)


def bench_remat(args) -> None:
    print(f"compiled loss-and-gradient, B={args.batch} H={args.hidden} L={args.layers}, model.recurrence=autodiff: "
          "XLA memory_analysis() temp_size_in_bytes (peak scratch, excludes params/inputs/outputs), MiB\n")
    print("| cell | T | no remat | remat | ratio |\n|---|---|---|---|---|")
    for cell in args.cells:
        for seq_len in args.seq_lens:
            mib = {}
            for remat in (False, True):
                config = dataclasses.replace(BASE, cell=cell, hidden_dim=args.hidden, num_layers=args.layers, remat=remat)
                model = build_model(config, 1)
                x = jnp.zeros((args.batch, seq_len, 2))
                params = jax.jit(model.init)(jax.random.key(0), x[:, :2])["params"]
                fn = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)))
                mib[remat] = fn.lower(params, x).compile().memory_analysis().temp_size_in_bytes / 2**20
            print(f"| {cell} | {seq_len} | {mib[False]:.1f} | {mib[True]:.1f} | {mib[True] / mib[False]:.2f} |", flush=True)


# The zoo's shapes: each preset as its sweep runs it (H=64, two layers, batch 64, each cell in its paper's block).
ZOO_SHAPES = {
    "state_tracking": ["experiment=zoo_state_tracking", "state_tracking=s3"],  # T=16 (parity's shape too)
    "mqar": ["experiment=zoo_mqar"],  # T=64, 8 pairs
    "selective_copy": ["experiment=zoo_selective_copy"],  # T=32 + 8 answers
    "text": ["experiment=zoo_text"],  # T=128, batch 32, H=128 (`python -m rnnlab.corpora prepare shakespeare` once)
}
# Every cell in its default form, and the state-tracking protocol's switch-on DeltaProduct rows.
ZOO_SETTINGS = [
    "gru", "lstm", "rnn", "mingru", "minlstm", "lru", "rglru", "attention", "slstm", "mlstm", "gla", "linear_attention",
    "deltanet", "gated_deltanet", "mamba", "mamba2", "rwkv7", "deltaproduct",
    "deltaproduct model.allow_neg_eigval=true", "deltaproduct model.num_householder=3 model.allow_neg_eigval=true",
]
ELMAN_ROW = ["model=rnn", "hidden_dim=100", "batch_size=32", "data.seq_len=100"]


def train_rate(overrides: list[str], steps: int) -> dict:
    """results.json of `train.py OVERRIDES` run for `steps` steps in this process (no checkpoint, one device,
    one log line and eval at the end)."""
    import contextlib
    import io
    import tempfile

    from hydra import compose, initialize_config_dir

    from rnnlab.config import from_omegaconf
    from rnnlab.trainer import train_and_evaluate

    fixed = [f"steps={steps}", f"log_every={steps}", "eval_every=1000000", "eval_batches=1",
             "checkpoint.enabled=false", "device.num_devices=1"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = from_omegaconf(compose(config_name="config", overrides=[*overrides, *fixed]))
    with tempfile.TemporaryDirectory(prefix="bench-zoo-") as workdir, contextlib.redirect_stdout(io.StringIO()):
        results = train_and_evaluate(config, workdir)  # its model summary is not part of the table
    # Drop this run's compiled programs: dozens of runs in one process otherwise exhaust the memory maps
    # that XLA's CPU code lives in ("LLVM ERROR: Unable to allocate section memory").
    jax.clear_caches()
    if results["status"] != "completed":  # SIGTERM or Ctrl-C stops the run (a preemption): stop the bench too
        sys.exit(f"bench_cells: a run ended {results['status']}: stopped")
    return results


def bench_flops(args) -> None:
    """Each setting's model FLOPs per train step against the GRU's at each zoo shape, counted (no run): the time
    ratio a cell reaches at the GRU's MFU."""
    from hydra import compose, initialize_config_dir

    from rnnlab import flops, tasks
    from rnnlab.config import from_omegaconf

    shapes = {name: ZOO_SHAPES[name] for name in args.shapes}
    settings = args.settings or ZOO_SETTINGS
    print("model FLOPs of a train step (forward, backward; the forms `auto` runs on this CPU) x the GRU's\n")
    print("| setting | " + " | ".join(shapes) + " |\n|---|" + "---|" * len(shapes))
    counts = {}
    for setting in dict.fromkeys(["gru", *settings]):
        for shape, preset in shapes.items():
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                try:
                    config = from_omegaconf(compose(config_name="config", overrides=[
                        *preset, f"model={setting.split()[0]}", *setting.split()[1:]]))
                except ConfigError:  # a setting this shape refuses (full attention on text)
                    counts[shape, setting] = None
                    continue
            task = tasks.make_task(config.data)
            model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
            counts[shape, setting] = flops.train_step_flops(model.config, task.input_dim, task.output_dim,
                                                            config.batch_size * task.total_len, task.total_len,
                                                            task.token_inputs, 1, model.layer_cells)
        row = [counts[shape, setting] and counts[shape, setting] / counts[shape, "gru"] for shape in shapes]
        print(f"| {setting} | " + " | ".join("refused" if r is None else f"{r:.1f}" for r in row) + " |")


def bench_zoo(args) -> None:
    import logging
    import platform

    logging.getLogger("rnnlab").setLevel(logging.WARNING)
    shapes = {name: ZOO_SHAPES[name] for name in args.shapes}
    settings = args.settings or ZOO_SETTINGS
    if "gru" not in settings:
        settings = ["gru", *settings]
    elman, rows = [], {(shape, setting): [] for shape in shapes for setting in settings}
    for _ in range(args.repeats):  # round-robin: load on the machine hits every setting alike
        r = train_rate(ELMAN_ROW, args.steps)
        elman.append(r["tokens_per_sec"])
        for shape, preset in shapes.items():
            for setting in settings:
                r = train_rate([*preset, *[f"model={setting.split()[0]}", *setting.split()[1:]]], args.steps)
                rows[shape, setting].append((1000 * r["tokens_per_step"] / r["tokens_per_sec"], r["mfu"],
                                             r["flops_per_step"]))
                print(f"  {shape} {setting}: {rows[shape, setting][-1][0]:.2f} ms/step", file=sys.stderr, flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}; median of {args.repeats} runs of {args.steps} steps each "
          f"(compile excluded), one job at a time.\nElman H=100 row (machine speed): "
          f"{statistics.median(elman):,.0f} tokens/s\n")
    for shape in shapes:
        gru = statistics.median(ms for ms, _, _ in rows[shape, "gru"])
        gru_flops = rows[shape, "gru"][0][2]
        # The model FLOPs of a step against the GRU's: a cell that does k times the GRU's work runs within k x the
        # GRU's time only at the GRU's MFU or better
        print(f"**{shape}** (`{' '.join(shapes[shape])}`)\n\n| setting | ms/step | x GRU | model FLOPs x GRU | MFU |\n"
              f"|---|---|---|---|---|")
        for setting in settings:
            ms = statistics.median(m for m, _, _ in rows[shape, setting])
            mfu = statistics.median(u for _, u, _ in rows[shape, setting] if u is not None) if any(
                u is not None for _, u, _ in rows[shape, setting]) else float("nan")
            print(f"| {setting} | {ms:.1f} | {ms / gru:.1f} | {rows[shape, setting][0][2] / gru_flops:.1f} | {mfu:.2f} |")
        print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["zoo", "flops", "init", "remat"])
    parser.add_argument("--shapes", nargs="+", choices=list(ZOO_SHAPES), default=[s for s in ZOO_SHAPES if s != "text"])
    parser.add_argument("--settings", nargs="+", help="zoo: cells, each optionally with overrides "
                        "('deltaproduct model.num_householder=3'); default: every cell and the switch-on DeltaProducts")
    parser.add_argument("--steps", type=int, default=300, help="zoo: train steps per run")
    parser.add_argument("--cells", nargs="+", default=["rnn", "lstm", "gru"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=100)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--layer-counts", type=int, nargs="+", default=[1, 4, 16, 48])
    parser.add_argument("--repeats", type=int, help="rounds, each variant once a round (default: zoo 3, else 5)")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.what == "zoo" else 5)
    cpu.set_cpu_xla_flags()  # as train.py compiles on CPU (before anything starts the backend)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()[0]:.2f} at start\n")
    {"zoo": bench_zoo, "flops": bench_flops, "init": bench_init, "remat": bench_remat}[args.what](args)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
