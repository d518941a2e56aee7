"""Evaluate trained runs at any length as RNNs: each run dir's newest checkpoint, its task at each length in
segments with the state carried (`data.eval_segment_len`), so a length of a million steps takes the memory of
one segment.

    python -m rnnlab.eval_long RUN_DIR... --lengths 16 128 1000 10000 100000 1000000 [--segment 4096]
        [--sequences 64] [--max-minutes 60] [--out long.csv]

(`python scripts/eval_long.py ...` runs the same.)

The sequences are the first `--sequences` of the run's own eval stream at each length (its seed, batch 0), so a
length the run evaluated itself scores the same examples. Prints a Markdown table (a row per run, a column per
length: the task's headline metric) and writes every metric to `--out`.

A long length states its predicted time once its first segments have run ("eval at length N: about X (measured
Y tokens/s)"); one predicted past `--max-minutes` is refused. A data=text run has no lengths to evaluate at: the
run itself evaluates its held-out plays whole (`data.eval_streams` streams, the state carried; rerun its command
with another `data.eval_streams` to evaluate it again), and is refused here. Exit codes, each with one line on
stderr: 0 done; 2 bad input (an option's value, a run dir without a config or a checkpoint, a data=text run, a
length refused by its predicted time); 75 stopped by SIGTERM or a first Ctrl-C between segments (the rows done so far are printed and written);
130 aborted by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path

import jax

from rnnlab import config as cfg
from rnnlab import exit_codes, steps, tasks, trained
from rnnlab.checkpoint import PreemptionGuard, saved_steps

EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_ABORTED = exit_codes.BAD_INPUT, exit_codes.PREEMPTED, exit_codes.ABORTED
DEFAULT_MAX_MINUTES = 60.0  # train.py's eval_max_minutes default
MAX_SEGMENT = 65_536  # a length up to --segment runs whole, in one call whose memory grows with it


class BadInput(Exception):
    """An option's value that cannot be evaluated: one line naming the option and what is allowed."""


class Stopped(Exception):
    """SIGTERM or a first Ctrl-C between segments."""

    def __init__(self, signal_name: str, rows: list[dict]):
        super().__init__(signal_name)
        self.rows = rows


def whole_number(low: int, high: int | None = None):
    """An argparse type: an integer in low .. high (ArgumentTypeError otherwise: argparse exits 2 naming the option)."""

    def parse(text: str) -> int:
        allowed = f"a whole number from {low:,} to {high:,}" if high is not None else f"a whole number >= {low:,}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {allowed}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"got {value:,}, allowed: {allowed}")
        return value

    return parse


def length(text: str) -> int:
    """--lengths: 1 .. tasks.MAX_EVAL_SEQ_LEN steps (train.py's cap on data.eval_seq_lens)."""
    try:
        return whole_number(1, tasks.MAX_EVAL_SEQ_LEN)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} steps (10^8 steps take hours even in segments)") from None


def minutes(text: str) -> float | None:
    """--max-minutes: a number > 0, or none (no limit)."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"got {text!r}, allowed: a number of minutes > 0, or none (no limit)")
    return value


def run_dir(text: str) -> Path:
    """A run dir of train.py: its composed config and at least one checkpoint."""
    try:
        run = trained.require_run_dir(text)
    except trained.RunError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not saved_steps(run / trained.CHECKPOINTS):
        raise argparse.ArgumentTypeError(f"{text!r} holds no checkpoint under checkpoints/ (allowed: a run dir "
                                         f"that saved one: checkpoint.enabled=true)")
    return run


def out_file(text: str) -> Path:
    path = Path(text)
    if path.is_dir() or not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (allowed: a file in an existing directory)")
    return path


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): `eval_long: error: argument --lengths: ...`."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"eval_long: error: {message}\n")


def parser() -> Parser:
    p = Parser(prog="eval_long", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("runs", nargs="+", type=run_dir, metavar="RUN_DIR")
    p.add_argument("--lengths", nargs="+", type=length, required=True,
                   help=f"steps to evaluate at (1 .. {tasks.MAX_EVAL_SEQ_LEN:,})")
    p.add_argument("--segment", type=whole_number(1, MAX_SEGMENT), default=4096,
                   help=f"steps per segment (data.eval_segment_len; 1 .. {MAX_SEGMENT:,}: a length up to it runs whole)")
    p.add_argument("--sequences", type=whole_number(1, steps.EVAL_BLOCK_TOKENS), default=64,
                   help=f"examples per length (1 .. {steps.EVAL_BLOCK_TOKENS:,}: a segment's tokens)")
    p.add_argument("--max-minutes", type=minutes, default=DEFAULT_MAX_MINUTES,
                   help="refuse a length whose measured speed predicts a longer evaluation (none: no limit)")
    p.add_argument("--metric", help="the metric of the table (default: the task's first; the CSV has them all)")
    p.add_argument("--out", type=out_file)
    return p


def load(run: Path, args: argparse.Namespace) -> tuple[cfg.Config, tasks.Task]:
    """The run's config for this evaluation and its task; BadInput for options its task cannot take."""
    try:
        config = trained.read_config(run)
    except trained.RunError as e:
        raise BadInput(f"argument RUN_DIR: {e}") from None
    config = dataclasses.replace(config, batch_size=args.sequences, eval_batches=1, eval_max_minutes=args.max_minutes,
                                 data=dataclasses.replace(config.data, eval_segment_len=args.segment))
    task = tasks.make_task(config.data)
    if steps.carries_state(task):  # its train state carries its streams' model state: not a task of lengths
        raise BadInput(f"argument RUN_DIR: {run} trained data={task.name}, which has no lengths to evaluate at: the "
                       f"run evaluates its held-out documents whole itself (bpc with the state carried through "
                       f"data.eval_streams streams, bpc_reset; the test documents at its end; results.json); allowed: "
                       f"runs of the tasks with a length; to evaluate a text run again, rerun its train.py command "
                       f"in its run dir with another data.eval_streams")
    short = [n for n in args.lengths if n < task.min_seq_len]
    if short:
        raise BadInput(f"argument --lengths: got {short[0]:,}, but the {task.name} task of {run} needs >= "
                       f"{task.min_seq_len}")
    if not task.segmentable() and any(task.with_seq_len(n).total_len > args.segment for n in args.lengths):
        raise BadInput(f"argument --lengths: the {task.name} task of {run} is not evaluated in segments; allowed: "
                       f"lengths whose examples fit in --segment={args.segment} steps")
    names = ("loss", *task.metric_names)
    if args.metric is not None and args.metric not in names:
        raise BadInput(f"argument --metric: got {args.metric!r}, allowed for the {task.name} task of {run}: "
                       f"{', '.join(names)}")
    return config, task


def evaluate_run(run: Path, config: cfg.Config, task: tasks.Task, lengths: list[int],
                 guard: PreemptionGuard | None = None) -> list[dict]:
    """One row per length: the run's newest checkpoint evaluated on its config's batch (`--sequences`) in segments
    of `data.eval_segment_len` (`--segment`). `guard`'s stop request ends it between segments (Stopped, holding
    the rows done); a length predicted past `eval_max_minutes` raises steps.EvalTooLongError."""
    try:
        loaded = trained.load_run(run)
    except trained.RunError as e:
        raise BadInput(f"argument RUN_DIR: {e}") from None
    for warning in loaded.warnings:
        print(f"eval_long: warning: {warning}", file=sys.stderr)
    should_stop = (lambda: guard.requested is not None) if guard is not None else None
    rows: list[dict] = []
    for n in lengths:
        if should_stop and should_stop():
            raise Stopped(guard.requested, rows)
        start = time.perf_counter()
        try:
            metrics = loaded.evaluate(n, config.batch_size, config.data.eval_segment_len, config.eval_max_minutes,
                                      should_stop)
        except steps.EvalInterrupted:
            raise Stopped(guard.requested, rows) from None
        rows.append({"run": str(run), "step": loaded.step, "length": n, "sequences": config.batch_size, **metrics,
                     "seconds": round(time.perf_counter() - start, 1)})
        jax.clear_caches()
    return rows


def too_long(error: steps.EvalTooLongError, args: argparse.Namespace) -> str:
    return (f"argument --lengths: evaluating length {error.length:,} of {args.sequences} sequences would take "
            f"{steps.prediction(error.seconds, error.tokens_per_sec)}, more than --max-minutes={args.max_minutes:g}; "
            f"allowed: shorter lengths, fewer --sequences, or a larger --max-minutes (none: no limit)")


def main(argv: list[str] | None = None) -> int:
    # On the CPU unless JAX_PLATFORMS says otherwise, set before JAX starts a backend (importing this module
    # sets nothing)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parser().parse_args(argv)
    shown = logging.StreamHandler(sys.stderr)  # the predicted time of a long length
    shown.setFormatter(logging.Formatter("eval_long: %(message)s"))
    level, propagate = steps.log.level, steps.log.propagate
    steps.log.addHandler(shown)
    steps.log.setLevel(logging.INFO)
    steps.log.propagate = False
    try:
        return evaluate_all(args)
    finally:
        steps.log.removeHandler(shown)
        steps.log.setLevel(level)
        steps.log.propagate = propagate


def evaluate_all(args: argparse.Namespace) -> int:
    """The table and the CSV of every run at every length; the exit code."""
    rows: list[dict] = []
    try:
        loaded = [(run, *load(run, args)) for run in args.runs]  # every run's options checked before any evaluates
        print("| run | step | metric | " + " | ".join(f"{n:,}" for n in args.lengths) + " |")
        print("|---|---|---|" + "---|" * len(args.lengths))
        with PreemptionGuard() as guard:
            for run, config, task in loaded:
                try:
                    mine = evaluate_run(run, config, task, args.lengths, guard)
                except Stopped as e:
                    rows += e.rows
                    table_row(e.rows, args.metric)
                    raise
                rows += mine
                table_row(mine, args.metric)
    except BadInput as e:
        write_csv(rows, args.out)
        print(f"eval_long: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except steps.EvalTooLongError as e:
        write_csv(rows, args.out)
        print(f"eval_long: error: {too_long(e, args)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Stopped as e:
        write_csv(rows, args.out)
        print(f"eval_long: stopped by {e} between segments: {len(rows)} row(s) done"
              + (f", written to {args.out}" if args.out and rows else ""), file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("eval_long: aborted by a second interrupt", file=sys.stderr)
        return EXIT_ABORTED
    write_csv(rows, args.out)
    return 0


def table_row(rows: list[dict], metric: str | None) -> None:
    """A run's row of the Markdown table: `metric` (default: the task's first) at each length done."""
    if not rows:
        return
    metric = metric or next(k for k in rows[0] if k not in ("run", "step", "length", "sequences", "loss"))
    print(f"| {rows[0]['run']} | {rows[0]['step']} | {metric} | " + " | ".join(f"{r[metric]:.4g}" for r in rows) + " |",
          flush=True)


def write_csv(rows: list[dict], out: Path | None) -> None:
    if not out or not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    raise SystemExit(main())
