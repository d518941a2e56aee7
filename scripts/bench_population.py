"""A grid as one program against separate processes: each cell's lr-and-seed sweep of a zoo preset run with
`hydra/launcher=population` (one program, a member axis) and with separate processes (`hydra/launcher=parallel`:
one per core, or many sharing one GPU; `basic`: one after another), as a user would type it.

    python scripts/bench_population.py                                   # CPU: zoo_mqar's grid, 2 cells, short
    python scripts/bench_population.py --cells gru deltanet mamba2 gated_deltanet --steps 1000   # a GPU lease
    python scripts/bench_population.py --toy --cells gru --lrs 1e-3 3e-3 --seeds 1    # the script's own check

Per cell and launcher: the sweep's wall seconds (process starts and compiles included: what the user waits for),
each member's steps/s in the steady state (results.json's tokens/s over its tokens per step; median over the
jobs), the grid's steps/s (every member's steps over the sweep's wall seconds), the train-step compiles (one per
process, or one per population),
the largest process's peak RSS (in a parallel sweep, one of several side by side), and the device's peak memory where it reports one (results.json's
`peak_device_bytes`). Writes a JSON (`--json`) and prints a Markdown table. Nothing else may run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("population", "parallel", "basic")
TOY = ["hidden_dim=8", "batch_size=8", "data.num_pairs=2", "data.seq_len=8", "data.eval_seq_lens=[8]",
       "eval_batches=1", "log_every=5", "eval_every=10"]


# Runs a command and writes the largest peak RSS (KiB) of the processes it waited for: the sweep's own, per sweep.
MAXRSS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); open(sys.argv[1], 'w').write("
          "str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)")


def sweep(cell: str, launcher: str, args: argparse.Namespace) -> dict:
    """One cell's sweep under one launcher, in a fresh process; its figures."""
    out = args.out / cell.replace(" ", "_") / launcher
    shutil.rmtree(out, ignore_errors=True)
    name, *cell_overrides = cell.split()
    command = [sys.executable, str(ROOT / "train.py"), "-m", f"experiment={args.preset}", f"model={name}",
               *cell_overrides, f"optimizer.lr={','.join(args.lrs)}", f"seed=range(0,{args.seeds})",
               f"steps={args.steps}", f"hydra/launcher={launcher}", f"hydra.sweep.dir={out}",
               *(TOY if args.toy else [f"data.num_pairs={args.num_pairs}"]), *args.set]
    rss_file = out.parent / f"{launcher}.maxrss"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MAXRSS, str(rss_file), *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{cell} with {launcher} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    jobs = [json.loads(p.read_text()) for p in sorted(out.glob("*/results.json"))]
    rates = [j["tokens_per_sec"] / j["tokens_per_step"] for j in jobs if j.get("tokens_per_sec")]
    peaks = [j["peak_device_bytes"] for j in jobs if j.get("peak_device_bytes")]
    return {
        "cell": cell, "launcher": launcher, "jobs": len(jobs), "wall_seconds": wall,
        "steps_per_sec_per_member": statistics.median(rates) if rates else None,
        "grid_steps_per_sec": len(jobs) * args.steps / wall,  # every member's steps over the sweep's wall time
        "train_step_compiles": len(list(out.glob("population_*.log"))) if launcher == "population" else len(jobs),
        "compile_seconds": max(j["compile_seconds"] or 0 for j in jobs) if launcher == "population"
        else sum(j["compile_seconds"] or 0 for j in jobs),
        "peak_rss_mb": int(rss_file.read_text()) / 1024,
        "peak_device_mb": max(peaks) / 2**20 if peaks else None,
        "platform": jobs[0]["platform"], "eval_losses": [j["eval_loss"] for j in jobs],
    }


def table(rows: list[dict]) -> str:
    def f(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = ["| cell | launcher | jobs | wall s | steps/s per member | grid steps/s | compiles | compile s | "
             "peak RSS MB | peak device MB |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['launcher']} | {r['jobs']} | {r['wall_seconds']:.1f} | "
                     f"{f(r['steps_per_sec_per_member'], '.1f')} | {r['grid_steps_per_sec']:.1f} | "
                     f"{r['train_step_compiles']} | {r['compile_seconds']:.1f} | {f(r['peak_rss_mb'], '.0f')} | "
                     f"{f(r['peak_device_mb'], '.0f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="zoo_mqar", help="a zoo preset (conf/experiment/)")
    parser.add_argument("--cells", nargs="+", default=["gru", "deltanet"], help='model configs, "cell key=value ..."')
    parser.add_argument("--lrs", nargs="+", default=["3e-4", "1e-3", "3e-3", "1e-2"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-pairs", type=int, default=8, help="zoo_mqar's data.num_pairs")
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every sweep")
    parser.add_argument("--toy", action="store_true", help="tiny sizes: checks the script in seconds")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_population"))
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    rows = []
    for cell in args.cells:
        for launcher in args.launchers:
            rows.append(sweep(cell, launcher, args))
            print(f"{cell} / {launcher}: {rows[-1]['wall_seconds']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:], "cpu_count": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
