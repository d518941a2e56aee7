"""Time `scripts/benchmark.py`'s fair torch step alone, in a process of its own.

    python scripts/torch_step.py lstm 1024 64 128 1          # cell H B T L: ms per step and tokens/s
    python scripts/torch_step.py lstm 1024 64 128 1 --json t.json

`benchmark.py` times torch in the same process as rnnlab; where both run OpenMP thread teams
(rnnlab's oneDNN kernel, `model.recurrence=onednn`), each can slow the other. This times torch
alone, on the same task batch, to set beside `python train.py`'s tokens/s in turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import numpy as np
import torch

from rnnlab import cpu, steps, tasks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (this directory)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cell", choices=["rnn", "lstm", "gru"])
    parser.add_argument("shape", nargs=4, type=int, metavar="H B T L")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="least time per repeat")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    h, b, t, layers = args.shape
    task = tasks.make_task(benchmark.compose(args.cell, h, b, t, layers).data)
    sampler = steps.pmap_sampler(task, tasks.stream_key(0, 0), b, jax.devices()[:1])
    # The batch benchmark.py gives torch (its RnnlabStep.global_batch on one device).
    batch = jax.tree_util.tree_map(lambda x: np.asarray(x)[0], sampler(np.zeros(1, np.int32)))
    benchmark.setup_torch(torch, cpu.host_cores())
    step = benchmark.TorchStep(args.cell, h, b, t, layers, batch)
    step(1)
    n = max(1, int(args.min_seconds / benchmark.timed(step, 1)))
    ms = statistics.median(1e3 * benchmark.timed(step, n) for _ in range(args.repeats))
    result = {"cell": args.cell, "hidden": h, "batch": b, "time": t, "layers": layers, "torch_ms": ms,
              "tokens_per_sec": b * t / ms * 1e3, "steps_per_repeat": n, "repeats": args.repeats}
    print(f"torch {args.cell} H={h} B={b} T={t} L={layers}: {ms:.1f} ms/step, {result['tokens_per_sec']:,.0f} tokens/s "
          f"(median of {args.repeats} x {n} steps)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
