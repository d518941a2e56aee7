"""Every cell at one width and depth over long sequences, in each of its forms (`model.time_scan`):
tokens/s, memory and compile time.

    python scripts/bench_scans.py                                    # the full table (long: about an hour on 2 cores)
    python scripts/bench_scans.py --cells gla deltanet --seq-lens 1024 --repeats 3
    python scripts/bench_scans.py --cells mingru --recurrences custom_vjp autodiff   # both backwards
    python scripts/bench_scans.py --compile-layers 2 8 16            # compile seconds against depth only
    python scripts/bench_scans.py --compile-layers 4 12 --pattern gated_deltanet gated_deltanet gated_deltanet attention
    python scripts/bench_scans.py --cells mamba attention --seq-lens 1024 4096 --memory-only   # compile, don't run
    python scripts/bench_scans.py --as-configured --seq-lens 16384 --batch 1 --memory-only --train-rss   # as trained

Each row is rnnlab's train step as `scripts/benchmark.py`'s bare-step column times it (one
`train_step` per call under `jax.pmap` on one device, Adam, the adding task, H=256, B=16, L=2 by
default, `model.block=plain` for every cell so that rows differ only in the time mixer, the
matrix-state cells and attention with their configs' heads and chunk), with: tokens/s (median of
`--repeats`), the compiled step's memory from XLA's memory analysis (arguments + outputs not aliased
to them + temporaries: the step's peak as XLA plans it) and its compile seconds. Each cell runs
every form it has (`Cell.time_scans`, narrowed by `--scans`), with its config's `model.recurrence`
or each of `--recurrences`. A step that would not fit in free memory is compiled, not run, and its
row says so; `--memory-only` compiles every row and runs none (the memory column alone, for lengths
whose old forms would not fit). `--mixer` also times a whole-sequence cell's mixing alone (`jax.grad`
of its `mix` in its parameters and input term, no layer around it); `--set KEY=VALUE` overrides every
row that has the key (`--set model.chunk_size=32`: the cells with chunks). `--as-configured` runs each cell as its model config has it instead:
its default form and its block (the memory table of docs/benchmarks.md). `--train-rss` adds the peak
resident memory of `python train.py` running two steps of the row's config (its own process, so the
number is what a user's run holds: the compile, the task, the checkpointer and the step; read with
`os.wait4`). Results also go to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402

from benchmark import RnnlabStep, compose, load  # noqa: E402  (scripts/benchmark.py)
from rnnlab import memory  # noqa: E402
from rnnlab.cells import SequenceCell, cell_names, get_cell  # noqa: E402

MIB = 2**20


def variants(cell: str, scans: list[str], recurrences: list[str], as_configured: bool = False,
             ) -> list[tuple[str, str | None]]:
    """(time_scan, recurrence) pairs a cell runs: each of its forms in `scans` (all, if none is; its
    config's default form alone if `as_configured`), with each of `recurrences`, or with its config's (None)."""
    if as_configured:
        forms = [compose(cell, 8, 1, 8, 1).model.time_scan]
    else:
        forms = [s for s in get_cell(cell).time_scans if not scans or s in scans]
    return [(s, r) for s in forms for r in (recurrences or [None])]


def overrides_for(cell: str, overrides: list[str]) -> list[str]:
    """`--set` overrides that apply to `cell`: a cell option (`model.chunk_size`) only for the cells that have it."""
    own = get_cell(cell).__dataclass_fields__
    options = {f for name in cell_names() for f in get_cell(name).__dataclass_fields__}
    key = lambda o: o.split("=", 1)[0].lstrip("+").removeprefix("model.")  # noqa: E731
    return [o for o in overrides if not o.lstrip("+").startswith("model.") or key(o) in own or key(o) not in options]


def train_overrides(cell: str, time_scan: str, recurrence: str | None, args, t: int) -> list[str]:
    """The row as `python train.py` overrides (two steps, no eval or checkpoint)."""
    return [f"model={cell}", f"model.time_scan={time_scan}", f"hidden_dim={args.hidden}", f"num_layers={args.layers}",
            f"batch_size={args.batch}", "data=adding", f"data.seq_len={t}", "device.num_devices=1", "steps=2",
            "log_every=1", "eval_every=1000000", "checkpoint.enabled=false",
            *([] if args.as_configured else ["model.block=plain"]),
            *([f"model.recurrence={recurrence}"] if recurrence else []), *overrides_for(cell, args.set)]


def train_peak_rss_mib(overrides: list[str]) -> tuple[float, int]:
    """(peak resident MiB, exit code) of `python train.py <overrides>` in a fresh run dir."""
    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                                cwd=run_dir, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, with its own rusage
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        if code:
            err.seek(0)
            lines = err.read().strip().splitlines()
            print(f"train.py exit {code}: {lines[-1] if lines else ''}", file=sys.stderr)
        return usage.ru_maxrss / 1024, code  # ru_maxrss: KiB on Linux


def mixer_seconds(config, repeats: int, min_seconds: float) -> float:
    """Median seconds of the cell's time mixing alone, forward and backward: `jax.grad` of sum(mix(u) * w) in
    the cell's parameters and its input term u: [T, B, W] (one layer, no input map, norm or MLP)."""
    import jax.numpy as jnp

    m = config.model
    cell = get_cell(m.cell)(hidden_dim=m.hidden_dim, init=m.init, **dict(m.options))
    t, b = config.data.seq_len, config.batch_size
    keys = jax.random.split(jax.random.key(0), len(cell.param_specs()) + 3)
    params = {name: init(k, shape) for (name, (shape, init)), k in zip(cell.param_specs().items(), keys[3:])}
    u = jax.random.normal(keys[0], (t, b, cell.input_width)) * 0.5
    x = jax.random.normal(keys[1], (t, b, m.hidden_dim))
    w = jax.random.normal(keys[2], (t, b, m.hidden_dim))
    unroll = m.unroll or 1
    grad = jax.jit(jax.grad(lambda p, u: jnp.sum(cell.mix(p, u, x, m.time_scan, unroll, m.recurrence) * w),
                            argnums=(0, 1)))
    jax.block_until_ready(grad(params, u))  # compile
    times = []
    for _ in range(repeats):
        n, elapsed = 0, 0.0
        t0 = time.perf_counter()
        while elapsed < min_seconds or n == 0:
            jax.block_until_ready(grad(params, u))
            n, elapsed = n + 1, time.perf_counter() - t0
        times.append(elapsed / n)
    return statistics.median(times)


def step_bytes(compiled) -> float:
    """Arguments + outputs not aliased to donated arguments + temporaries, from XLA's memory analysis."""
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
                 + m.temp_size_in_bytes)


def time_row(cell: str, time_scan: str, recurrence: str, args, t: int) -> dict:
    extra = [f"model.time_scan={time_scan}", "device.num_devices=1", *overrides_for(cell, args.set)] + (
        [] if args.as_configured else ["model.block=plain"])
    extra += [f"model.recurrence={recurrence}"] if recurrence else []
    config = compose(cell, args.hidden, args.batch, t, args.layers, extra)
    step = RnnlabStep(config)
    row = {"cell": cell, "time_scan": time_scan, "recurrence": config.model.recurrence, "T": t, "H": args.hidden,
           "B": args.batch, "L": args.layers, "memory_mib": step_bytes(step.p_step) / MIB,
           "compile_seconds": step.compile_seconds, "load": load()}
    if args.train_rss:
        row["train_rss_mib"], row["train_exit"] = train_peak_rss_mib(train_overrides(cell, time_scan, recurrence, args, t))
    if args.memory_only:
        return row | {"ms_per_step": None, "tokens_per_sec": None, "skipped": "memory only"}
    free = memory.free_bytes(step.devices)
    if free is not None and row["memory_mib"] * MIB > 0.9 * free:
        return row | {"ms_per_step": None, "tokens_per_sec": None, "skipped": f"needs {row['memory_mib']:,.0f} MiB"}
    seconds_per_step = []
    step(1)  # warm up
    for _ in range(args.repeats):
        n, t0 = 1, time.perf_counter()
        step(n)
        elapsed = time.perf_counter() - t0
        while elapsed < args.min_seconds:  # enough steps for a stable time
            n = max(n + 1, int(n * args.min_seconds / max(elapsed, 1e-3)))
            t0 = time.perf_counter()
            step(n)
            elapsed = time.perf_counter() - t0
        seconds_per_step.append(elapsed / n)
    median = statistics.median(seconds_per_step)
    if args.mixer and issubclass(get_cell(cell), SequenceCell):
        row["mixer_ms"] = 1e3 * mixer_seconds(config, args.repeats, args.min_seconds)
    return row | {"ms_per_step": 1e3 * median, "tokens_per_sec": args.batch * t / median, "load": load()}


def compile_rows(args) -> list[dict]:
    """Compile seconds of each cell's step (as its config has it) at each of `--compile-layers`; with
    `--pattern`, of that hybrid (`model=<its first cell> model.pattern=[...]`) instead."""
    rows = []
    print(f"compile seconds against num_layers (H={args.hidden}, B={args.batch}, T={args.seq_lens[0]}, layer scan)")
    pattern = ["model.pattern=[" + ",".join(args.pattern) + "]"] if args.pattern else []
    for cell in [args.pattern[0]] if args.pattern else args.cells:
        name = "+".join(args.pattern) if args.pattern else cell
        for layers in args.compile_layers:
            config = compose(cell, args.hidden, args.batch, args.seq_lens[0], layers, ["device.num_devices=1", *pattern])
            seconds = RnnlabStep(config).compile_seconds
            rows.append({"cell": name, "L": layers, "compile_seconds": seconds, "load": load()})
            print(f"  {name:8} L={layers:<3} compile {seconds:6.2f} s | load {load():.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=list(cell_names()), choices=cell_names())
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--scans", nargs="*", default=[], help="forms to run (default: every form of each cell)")
    parser.add_argument("--recurrences", nargs="*", default=[], help="model.recurrence values (default: the config's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--compile-layers", nargs="*", type=int, help="only compile seconds for these num_layers")
    parser.add_argument("--pattern", nargs="*", default=[], choices=cell_names(), metavar="CELL",
                        help="with --compile-layers: a hybrid's model.pattern instead of each cell")
    parser.add_argument("--memory-only", action="store_true", help="compile each row for its memory; run none")
    parser.add_argument("--as-configured", action="store_true",
                        help="each cell's config's own form and block (default: every form, model.block=plain)")
    parser.add_argument("--train-rss", action="store_true", help="also the peak RSS of train.py running the row")
    parser.add_argument("--mixer", action="store_true",
                        help="also time the whole-sequence cells' mixing alone (forward and backward of `mix`)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for every row, e.g. model.chunk_size=32")
    parser.add_argument("--json", type=Path, default=Path("bench_scans.json"))
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.platform}:{device.device_kind} | jax {jax.__version__} | load {load():.2f}")
    if args.compile_layers:
        result = {"compile": compile_rows(args)}
    else:
        rows = []
        print(f"{'cell':16} {'scan':11} {'backward':10} {'T':>5} {'ms/step':>9} {'tokens/s':>10} "
              f"{'memory MiB':>10} {'compile s':>9}")
        for t in args.seq_lens:
            for cell in args.cells:
                for time_scan, recurrence in variants(cell, args.scans, args.recurrences, args.as_configured):
                    row = time_row(cell, time_scan, recurrence, args, t)
                    rows.append(row)
                    timing = (f"{row['ms_per_step']:9.2f} {row['tokens_per_sec']:10,.0f}" if row["tokens_per_sec"]
                              else f"{'not run:':>9} {'mem only' if args.memory_only else 'too big':>10}")
                    mixer = f" | mixing alone {row['mixer_ms']:.2f} ms" if row.get("mixer_ms") else ""
                    rss = (f" | train.py peak RSS {row['train_rss_mib']:,.0f} MiB (exit {row['train_exit']})"
                           if args.train_rss else "")
                    print(f"{cell:16} {time_scan:11} {row['recurrence']:10} {t:5d} {timing} "
                          f"{row['memory_mib']:10.1f} {row['compile_seconds']:9.2f} | load {row['load']:.2f}{mixer}{rss}",
                          flush=True)
        result = {"rows": rows}
    result["device"] = f"{device.platform}:{device.device_kind}"
    args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
