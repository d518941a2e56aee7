"""Measure this device's achievable matmul FLOP/s and cache the peak for rnnlab's MFU.

    python -m rnnlab.peak_flops                        # N = 256 .. 4096: float32 (HIGHEST), float32 at default precision, bfloat16
    python -m rnnlab.peak_flops --sizes 512 1024 --repeats 5 --no-save

(`python scripts/peak_flops.py` still runs it.)

Each entry is the median of `--repeats` timed runs of a jitted [N, N] x [N, N] matmul
(each run ends on block_until_ready). Columns are `rnnlab.flops.PEAK_KINDS`: float32 at
precision=HIGHEST, float32 at JAX's default precision (what the model's matmuls run at:
TF32 on NVIDIA GPUs since Ampere; on CPU it is the float32 matmul itself, so it is not
measured twice there), and bfloat16. The largest value per kind is saved as that kind's
peak under $XDG_CACHE_HOME/rnnlab/peak_flops.json (default ~/.cache/rnnlab/), keyed by
device kind; training reads it to report perf/mfu. Takes about a minute on a 2-core CPU
(N=4096 in float32 is ~2 s a run).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax

from rnnlab import flops

SIZES = (256, 512, 1024, 2048, 4096)
KINDS = tuple(flops.PEAK_KINDS)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="peak_flops", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="matrix sizes N")
    parser.add_argument("--kinds", nargs="+", choices=KINDS,
                        help="peak kinds to measure (default: all; on CPU float32_default is float32, not measured twice)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per entry (the median is kept)")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="each timed run repeats the matmul this long")
    parser.add_argument("--no-save", action="store_true", help="print only; leave the cache alone")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    kinds = args.kinds or [k for k in KINDS if not (device.platform == "cpu" and k == "float32_default")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device: {flops.device_key(device)} | load average {load:.2f} | median of {args.repeats}")
    print(f"{'N':>6} " + " ".join(f"{k + ' GFLOP/s':>26}" for k in kinds))
    table: dict[str, dict[int, float]] = {k: {} for k in kinds}
    for n in args.sizes:
        row = []
        for kind in kinds:
            rate = flops.measure_matmul_flops(n, kind, device, repeats=args.repeats, min_seconds=args.min_seconds)
            table[kind][n] = rate
            row.append(f"{rate / 1e9:26.1f}")
        print(f"{n:>6} " + " ".join(row), flush=True)

    result = {"device": flops.device_key(device), "load_average": load, "repeats": args.repeats, "table": table, "peak": {}}
    for kind, rates in table.items():
        n_best = max(rates, key=rates.get)
        result["peak"][kind] = rates[n_best]
        print(f"peak {kind}: {rates[n_best] / 1e9:.1f} GFLOP/s at N={n_best}")
        if not args.no_save:
            flops.save_peak(device, kind, rates[n_best], source="python -m rnnlab.peak_flops", n=n_best, load_average=load)
    if not args.no_save:
        print(f"saved to {flops.cache_path()}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
