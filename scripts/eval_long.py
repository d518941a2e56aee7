"""Evaluate trained runs at any length as RNNs: each run dir's newest checkpoint, its task at each length in
segments with the state carried (`data.eval_segment_len`), so a length of a million steps takes the memory of
one segment.

    python scripts/eval_long.py RUN_DIR... --lengths 16 128 1000 10000 100000 1000000 [--segment 4096]
        [--sequences 64] [--out long.csv]

The sequences are the first `--sequences` of the run's own eval stream at each length (its seed, batch 0), so a
length the run evaluated itself scores the same examples. Prints a Markdown table (a row per run, a column per
length: the task's headline metric) and writes every metric to `--out`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rnnlab import config as cfg  # noqa: E402
from rnnlab import parallel, steps, tasks  # noqa: E402
from rnnlab.checkpoint import Checkpointer  # noqa: E402
from rnnlab.models import build_model  # noqa: E402


def evaluate_run(run: Path, lengths: list[int], segment: int, sequences: int) -> list[dict]:
    """One row per length: the run's newest checkpoint evaluated on `sequences` examples."""
    config = cfg.from_omegaconf(OmegaConf.load(run / ".hydra" / "config.yaml"))
    config = dataclasses.replace(config, batch_size=sequences, eval_batches=1,
                                 data=dataclasses.replace(config.data, eval_segment_len=segment))
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    target = steps.create_train_state(jax.random.key(0), model, task.example_inputs(1), tx)
    checkpointer = Checkpointer(run / "checkpoints", 0, 1)
    try:
        restored = checkpointer.restore_latest(target)
    finally:
        checkpointer.close()
    if restored is None:
        raise SystemExit(f"eval_long: no checkpoint under {run / 'checkpoints'}")
    state, step, _ = restored
    dp = parallel.DataParallel(jax.devices()[:1], "pmap")
    replicated = dp.replicate(state)
    rows = []
    for length in lengths:
        at = task.with_seq_len(length)
        evaluator = (steps.make_segment_evaluator(config, at, sequences, dp, segment) if at.total_len > segment
                     else steps.make_evaluator(config, at, sequences, dp))
        start = time.perf_counter()
        metrics = dp.to_host(evaluator.step(replicated, evaluator.batches[0]))
        rows.append({"run": str(run), "step": step, "length": length, "sequences": sequences,
                     **{k: float(np.asarray(v).reshape(-1)[0]) for k, v in metrics.items()},
                     "seconds": round(time.perf_counter() - start, 1)})
        jax.clear_caches()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--lengths", nargs="+", type=int, required=True)
    parser.add_argument("--segment", type=int, default=4096, help="steps per segment (data.eval_segment_len)")
    parser.add_argument("--sequences", type=int, default=64, help="examples per length")
    parser.add_argument("--metric", help="the metric of the table (default: the task's first; the CSV has them all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    print("| run | step | metric | " + " | ".join(f"{n:,}" for n in args.lengths) + " |")
    print("|---|---|---|" + "---|" * len(args.lengths))
    for run in args.runs:
        mine = evaluate_run(run, args.lengths, args.segment, args.sequences)
        rows += mine
        metric = args.metric or next(k for k in mine[0] if k not in ("run", "step", "length", "sequences", "loss"))
        print(f"| {run} | {mine[0]['step']} | {metric} | " + " | ".join(f"{r[metric]:.4g}" for r in mine) + " |", flush=True)
    if args.out:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
