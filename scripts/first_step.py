"""Time to the first step from empty caches: `python train.py` for each cell (or shape), each in a fresh process
with a fresh `XDG_CACHE_HOME` (no device-count or peak FLOP/s cache) and no JAX compilation cache.

    python scripts/first_step.py                                   # debug=fast of every cell
    python scripts/first_step.py --cells gla deltanet --set data=mqar data.num_pairs=2 hidden_dim=24

Per row: the process's wall, results.json's `wall_seconds` (from `train_and_evaluate`'s start) and
`compile_seconds` (the train step's compile), and the two differences the issue's goal reads (wall minus
compile), with the median over `--repeats`.
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
sys.path.insert(0, str(ROOT))

from rnnlab.cells import cell_names  # noqa: E402


def run_once(cell: str, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "debug=fast", f"model={cell}", *overrides,
                               f"hydra.run.dir={run_dir}"], cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{cell}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        results = json.loads((run_dir / "results.json").read_text())
    return {"process_wall": wall, "run_wall": results["wall_seconds"], "compile": results["compile_seconds"]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(cell_names()), choices=cell_names())
    parser.add_argument("--set", nargs="*", default=[], help="further train.py overrides for every row")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    print("| cell | process wall s | run wall s | compile s | process wall - compile s | run wall - compile s |")
    print("|---|---|---|---|---|---|")
    rows = []
    for cell in args.cells:
        runs = [run_once(cell, args.set) for _ in range(args.repeats)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["cell"] = cell
        rows.append(row)
        print(f"| {cell} | {row['process_wall']:.1f} | {row['run_wall']:.1f} | {row['compile']:.1f} | "
              f"{row['process_wall'] - row['compile']:.1f} | {row['run_wall'] - row['compile']:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
