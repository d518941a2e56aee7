"""What truncated BPTT costs: the training loop's dispatch on data=text with the state carried from step to step,
with it reset every step (data.carry_state=false), and on a synthetic task of the same shape (MQAR: 256 symbols in,
256 out, T / 8 pairs, the same batch and T), side by side in one process, each timed in turn within every repeat.

    python scripts/bench_text.py                                       # LSTM, H=128, 2 layers, batch 32, T=128
    python scripts/bench_text.py --cells lstm mamba gated_deltanet "attention model.window=128" --repeats 5
    python scripts/bench_text.py --cells gru --data data.corpus=file data.corpus_dir=DIR   # another corpus

Each config is the step `python train.py` runs, as scripts/benchmark.py's `LoopDispatch` times it (`steps.make_dispatch`:
device.steps_per_dispatch steps a call, each drawing its batch on the devices, the carried state in the train state,
nothing copied to the host but the metrics), on one device. Prints a table (median ms per step, tokens/s, and each text loop's ratio to the synthetic one) and,
with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from hydra.errors import HydraException  # noqa: E402

from benchmark import LoopDispatch, compose_overrides  # noqa: E402  (scripts/benchmark.py)
from rnnlab import config as cfg  # noqa: E402
from rnnlab import corpora, exit_codes, tasks  # noqa: E402
from rnnlab.setup import check_stream_task  # noqa: E402


def variants(seq_len: int) -> dict[str, list[str]]:
    """name -> the data overrides beside the shared ones (MQAR with seq_len / 8 pairs: 16 at T=128)."""
    return {"text, carried": ["data=text"], "text, reset": ["data=text", "data.carry_state=false"],
            "mqar (synthetic)": ["data=mqar", "data.vocab_size=256", f"data.num_pairs={max(1, seq_len // 8)}"]}


def loop_of(overrides: list[str]) -> LoopDispatch:
    """The training loop's dispatch on one device for `overrides`, checked as train.py checks them first (exit 2,
    one line, before any compile)."""
    try:
        config = compose_overrides(overrides)
        task = tasks.make_task(config.data)
        if task.name == "text":
            check_stream_task(config, task)
    except (cfg.ConfigError, corpora.CorpusError, HydraException, ValueError) as e:
        print(f"bench_text: error: {' '.join(overrides)}: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(exit_codes.BAD_INPUT)
    return LoopDispatch(config, 1)


def seconds(loop: LoopDispatch, n: int) -> float:
    start = time.perf_counter()
    loop(n)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["lstm"], help='cells, each with keys of its own: "attention model.window=128"')
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="steps timed per repeat (rounded to the dispatch size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data", nargs="*", default=[], help="further data overrides for the text configs")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    for name, value in (("--hidden", args.hidden), ("--layers", args.layers), ("--batch", args.batch),
                        ("--seq-len", args.seq_len), ("--steps", args.steps), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{name}: got {value}, allowed: an integer >= 1")
    rows = []
    print(f"{jax.devices()[0].device_kind}, 1 device; H={args.hidden}, {args.layers} layers, batch {args.batch}, "
          f"T={args.seq_len}, {args.steps} steps x {args.repeats} repeats (median)")
    print(f"{'cell':<16} {'loop':<18} {'ms/step':>9} {'tokens/s':>11} {'vs synthetic':>13}")
    for cell in args.cells:  # a cell's name, then any keys of its own: "attention model.window=128"
        name, *keys = cell.split()
        shared = [f"model={name}", *keys, f"hidden_dim={args.hidden}", f"num_layers={args.layers}", f"batch_size={args.batch}",
                  f"data.seq_len={args.seq_len}", "device.num_devices=1", "steps=1000"]
        loops = {name: loop_of([*shared, *data, *(args.data if data[0] == "data=text" else [])])
                 for name, data in variants(args.seq_len).items()}
        k = loops["text, carried"].k
        n = max(k, args.steps // k * k)
        times = {name: [] for name in loops}
        for _ in range(args.repeats):  # in turn within each repeat, so that a change in load hits them alike
            for name, loop in loops.items():
                times[name].append(seconds(loop, n) / n)
        base = statistics.median(times["mqar (synthetic)"])
        for name in loops:
            per_step = statistics.median(times[name])
            row = {"cell": cell, "loop": name, "ms_per_step": 1e3 * per_step,
                   "tokens_per_sec": args.batch * args.seq_len / per_step, "vs_synthetic": base / per_step,
                   "hidden": args.hidden, "layers": args.layers, "batch": args.batch, "seq_len": args.seq_len,
                   "device": jax.devices()[0].device_kind}
            rows.append(row)
            print(f"{cell:<16} {name:<18} {row['ms_per_step']:>9.2f} {row['tokens_per_sec']:>11,.0f} "
                  f"{row['vs_synthetic']:>12.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
