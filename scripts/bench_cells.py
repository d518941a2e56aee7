"""Measure model options that are not about step time, side by side in one process.

    python scripts/bench_cells.py init    # init + compile time of the stacked layers, scan vs vmap init
    python scripts/bench_cells.py remat   # XLA's peak temp memory of the compiled gradient, remat on vs off

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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rnnlab import cpu  # noqa: E402
from rnnlab.config import ModelConfig  # noqa: E402
from rnnlab.models import build_model  # noqa: E402

BASE = ModelConfig(
    cell="rnn", hidden_dim=64, num_layers=1, init="orthogonal", activation="tanh", scan_layers=True,
    stack_init="scan", forget_bias=1.0, recurrence="autodiff", remat=False, dtype="float32", unroll=1, dropout=0.0,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["init", "remat"])
    parser.add_argument("--cells", nargs="+", default=["rnn", "lstm", "gru"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=100)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--layer-counts", type=int, nargs="+", default=[1, 4, 16, 48])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    cpu.set_cpu_xla_flags()  # as train.py compiles on CPU (before anything starts the backend)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()[0]:.2f} at start\n")
    {"init": bench_init, "remat": bench_remat}[args.what](args)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
