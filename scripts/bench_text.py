"""What truncated BPTT costs: the training loop's dispatch on data=text with the state carried from step to step,
with it reset every step (data.carry_state=false), and on a synthetic task of the same shape (MQAR: 256 symbols in,
256 out, T / 8 pairs, the same batch and T), side by side in one process, each timed in turn within every repeat.

    python scripts/bench_text.py                                       # LSTM, H=128, 2 layers, batch 32, T=128
    python scripts/bench_text.py --cells lstm mamba gated_deltanet --repeats 5
    python scripts/bench_text.py --cells gru --data data.corpus=file data.corpus_dir=DIR   # another corpus

Each config is the step `python train.py` runs (`steps.make_dispatch`: device.steps_per_dispatch steps a call, each
drawing its batch on the devices, the carried state in the train state, nothing copied to the host but the metrics),
on one device. Prints a table (median ms per step, tokens/s, and each text loop's ratio to the synthetic one) and,
with --json, writes the rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from rnnlab import config as cfg  # noqa: E402
from rnnlab import loop, parallel, steps, tasks  # noqa: E402
from rnnlab.models import build_model  # noqa: E402

def variants(seq_len: int) -> dict[str, list[str]]:
    """name -> the data overrides beside the shared ones (MQAR with seq_len / 8 pairs: 16 at T=128)."""
    return {"text, carried": ["data=text"], "text, reset": ["data=text", "data.carry_state=false"],
            "mqar (synthetic)": ["data=mqar", "data.vocab_size=256", f"data.num_pairs={max(1, seq_len // 8)}"]}


def compose(overrides: list[str]) -> cfg.Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return cfg.from_omegaconf(hydra_compose(config_name="config", overrides=list(overrides)))


class Loop:
    """`steps.make_dispatch` on one device for `config`, its state built as train.py builds it (a
    `CarryTrainState` for a stream task), compiled at construction."""

    def __init__(self, config: cfg.Config):
        self.task = tasks.make_task(config.data)
        self.dp = parallel.DataParallel(jax.devices()[:1], "pmap")
        self.k = config.device.steps_per_dispatch or steps.default_steps_per_dispatch(jax.devices()[0].platform)
        model = build_model(config.model, self.task.output_dim, input_dim=self.task.input_dim)
        tx, _ = steps.make_optimizer(config.optimizer, config.steps)
        carry = config.batch_size if steps.carries_state(self.task) else 0
        state = steps.create_train_state(jax.random.key(0), model, self.task.example_inputs(config.batch_size), tx,
                                         carry_batch=carry)
        self.state = self.dp.replicate(state)
        self.dispatch = steps.make_dispatch(config, self.task, self.dp, config.batch_size, self.k)
        self.tokens_per_step = config.batch_size * config.data.seq_len
        self(self.k)  # compile and warm up

    def __call__(self, n: int) -> float:
        """Seconds for n steps (a multiple of k), at most 16 steps in flight as in the training loop."""
        start, queued = time.perf_counter(), collections.deque()
        for _ in range(n // self.k):
            while len(queued) * self.k + self.k > loop.MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(queued.popleft())
            self.state, metrics = self.dispatch(self.state, self.k)
            queued.append(metrics)
        jax.block_until_ready(self.state)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["lstm"])
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
    for cell in args.cells:
        shared = [f"model={cell}", f"hidden_dim={args.hidden}", f"num_layers={args.layers}", f"batch_size={args.batch}",
                  f"data.seq_len={args.seq_len}", "device.num_devices=1", "steps=1000"]
        loops = {}
        for name, data in variants(args.seq_len).items():
            extra = args.data if data[0] == "data=text" else []
            try:
                loops[name] = Loop(compose([*shared, *data, *extra]))
            except (cfg.ConfigError, ValueError) as e:
                print(f"bench_text: error: {cell}, {name}: {e}", file=sys.stderr)
                sys.exit(2)
        n = max(loops["text, carried"].k, args.steps // loops["text, carried"].k * loops["text, carried"].k)
        times = {name: [] for name in loops}
        for _ in range(args.repeats):  # in turn within each repeat, so that a change in load hits them alike
            for name, fn in loops.items():
                times[name].append(fn(n) / n)
        base = statistics.median(times["mqar (synthetic)"])
        for name, fn in loops.items():
            per_step = statistics.median(times[name])
            row = {"cell": cell, "loop": name, "ms_per_step": 1e3 * per_step,
                   "tokens_per_sec": fn.tokens_per_step / per_step, "vs_synthetic": base / per_step,
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
