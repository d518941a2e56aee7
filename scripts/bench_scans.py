"""Every cell at one width and depth over long sequences, in each of its forms (`model.time_scan`):
tokens/s, memory and compile time.

    python scripts/bench_scans.py                                    # the full table (long: about an hour on 2 cores)
    python scripts/bench_scans.py --cells gla deltanet --seq-lens 1024 --repeats 3
    python scripts/bench_scans.py --cells mingru --recurrences custom_vjp autodiff   # both backwards
    python scripts/bench_scans.py --compile-layers 2 8 16            # compile seconds against depth only
    python scripts/bench_scans.py --cells mamba attention --seq-lens 1024 4096 --memory-only   # compile, don't run

Each row is rnnlab's train step as `scripts/benchmark.py`'s bare-step column times it (one
`train_step` per call under `jax.pmap` on one device, Adam, the adding task, H=256, B=16, L=2 by
default, `model.block=plain` for every cell so that rows differ only in the time mixer, the
matrix-state cells and attention with their configs' heads and chunk), with: tokens/s (median of
`--repeats`), the compiled step's memory from XLA's memory analysis (arguments + outputs not aliased
to them + temporaries: the step's peak as XLA plans it) and its compile seconds. Each cell runs
every form it has (`Cell.time_scans`, narrowed by `--scans`), with its config's `model.recurrence`
or each of `--recurrences`. A step that would not fit in free memory is compiled, not run, and its
row says so; `--memory-only` compiles every row and runs none (the memory column alone, for lengths
whose old forms would not fit). Results also go to `--json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402

from benchmark import RnnlabStep, compose, load  # noqa: E402  (scripts/benchmark.py)
from rnnlab import memory  # noqa: E402
from rnnlab.cells import cell_names, get_cell  # noqa: E402

MIB = 2**20


def variants(cell: str, scans: list[str], recurrences: list[str]) -> list[tuple[str, str | None]]:
    """(time_scan, recurrence) pairs a cell runs: each of its forms in `scans` (all, if none is), with
    each of `recurrences`, or with its config's (None)."""
    forms = [s for s in get_cell(cell).time_scans if not scans or s in scans]
    return [(s, r) for s in forms for r in (recurrences or [None])]


def step_bytes(compiled) -> float:
    """Arguments + outputs not aliased to donated arguments + temporaries, from XLA's memory analysis."""
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
                 + m.temp_size_in_bytes)


def time_row(cell: str, time_scan: str, recurrence: str, args, t: int) -> dict:
    extra = [f"model.time_scan={time_scan}", "model.block=plain", "device.num_devices=1"]
    extra += [f"model.recurrence={recurrence}"] if recurrence else []
    config = compose(cell, args.hidden, args.batch, t, args.layers, extra)
    step = RnnlabStep(config)
    row = {"cell": cell, "time_scan": time_scan, "recurrence": config.model.recurrence, "T": t, "H": args.hidden,
           "B": args.batch, "L": args.layers, "memory_mib": step_bytes(step.p_step) / MIB,
           "compile_seconds": step.compile_seconds, "load": load()}
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
    return row | {"ms_per_step": 1e3 * median, "tokens_per_sec": args.batch * t / median, "load": load()}


def compile_rows(args) -> list[dict]:
    rows = []
    print(f"compile seconds against num_layers (H={args.hidden}, B={args.batch}, T={args.seq_lens[0]}, layer scan)")
    for cell in args.cells:
        for layers in args.compile_layers:
            config = compose(cell, args.hidden, args.batch, args.seq_lens[0], layers, ["device.num_devices=1"])
            seconds = RnnlabStep(config).compile_seconds
            rows.append({"cell": cell, "L": layers, "compile_seconds": seconds})
            print(f"  {cell:8} L={layers:<3} compile {seconds:6.2f} s", flush=True)
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
    parser.add_argument("--memory-only", action="store_true", help="compile each row for its memory; run none")
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
                for time_scan, recurrence in variants(cell, args.scans, args.recurrences):
                    row = time_row(cell, time_scan, recurrence, args, t)
                    rows.append(row)
                    timing = (f"{row['ms_per_step']:9.2f} {row['tokens_per_sec']:10,.0f}" if row["tokens_per_sec"]
                              else f"{'not run:':>9} {'mem only' if args.memory_only else 'too big':>10}")
                    print(f"{cell:16} {time_scan:11} {row['recurrence']:10} {t:5d} {timing} "
                          f"{row['memory_mib']:10.1f} {row['compile_seconds']:9.2f} | load {row['load']:.2f}", flush=True)
        result = {"rows": rows}
    result["device"] = f"{device.platform}:{device.device_kind}"
    args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
