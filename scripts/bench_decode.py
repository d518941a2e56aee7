"""Decode speed and state size of every cell: prefill P tokens with the training form, then decode N tokens one
at a time from the state in one compiled loop (`rnnlab.decode`), at each batch size and context.

    python scripts/bench_decode.py                        # every cell, batch 1 and 64, contexts 1K .. 64K that fit
    python scripts/bench_decode.py --cells gru attention "attention model.window=512" --batches 1 --contexts 1024 65536

Each cell is its conf/model yaml (its paper's block) at `--hidden` x `--layers`, `--vocab` token ids in and
logits out, parameters at their initialisation (speed does not depend on training). A setting runs where
batch x context <= `--max-prefill-tokens` (the prefill, not the decode, is what grows). Reported: decode
tokens/s (batch x N / seconds, median of `--repeats`, compile excluded) and the state's bytes per sequence
(attention's cache of P + N steps; a recurrence's state whatever P). Writes a CSV (`--out`) and, with
matplotlib, a plot of both against the context (`--plot`); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rnnlab import config as cfg  # noqa: E402
from rnnlab.decode import decode, prefill  # noqa: E402
from rnnlab.models import build_model, initial_state, state_bytes  # noqa: E402

CELLS = ("rnn", "lstm", "gru", "mingru", "minlstm", "lru", "rglru", "mamba", "mamba2", "gla", "linear_attention",
         "deltanet", "gated_deltanet", "deltaproduct", "slstm", "mlstm", "rwkv7", "attention", "attention model.window=512")
FIELDS = ["cell", "batch", "context", "decode_steps", "decode_tokens_per_sec", "ms_per_token_step",
          "state_bytes_per_sequence", "prefill_seconds", "platform"]


def compose(cell: str, hidden: int, layers: int) -> cfg.Config:
    """`cell`: a model config's name, optionally with overrides ("attention model.window=512")."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    name, *overrides = cell.split()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return cfg.from_omegaconf(hydra_compose(config_name="config", overrides=[
            f"model={name}", f"hidden_dim={hidden}", f"num_layers={layers}", *overrides]))


def measure(cell: str, batch: int, context: int, args) -> dict:
    config = compose(cell, args.hidden, args.layers)
    model = build_model(config.model, output_dim=args.vocab, input_dim=args.vocab)
    prompt = jax.random.randint(jax.random.key(1), (batch, context), 0, args.vocab)
    params = jax.jit(model.init)(jax.random.key(0), prompt[:, :8])["params"]  # one program, not one a primitive
    state = initial_state(model, batch, context + args.decode)
    start = time.perf_counter()
    logits, state = prefill(model, params, prompt, state)
    jax.block_until_ready(state)
    prefill_seconds = time.perf_counter() - start
    first = logits[:, -1].argmax(-1)
    jax.block_until_ready(decode(model, params, state, first, args.decode))  # compile and warm up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(decode(model, params, state, first, args.decode))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"cell": cell, "batch": batch, "context": context, "decode_steps": args.decode,
            "decode_tokens_per_sec": round(batch * args.decode / seconds), "ms_per_token_step": round(1e3 * seconds / args.decode, 3),
            "state_bytes_per_sequence": state_bytes(jax.eval_shape(lambda: initial_state(model, 1, context + args.decode))),
            "prefill_seconds": round(prefill_seconds, 2), "platform": jax.devices()[0].platform}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4), squeeze=False)
    for cell in dict.fromkeys(r["cell"] for r in rows):
        for ax, batch in zip(axes[0], batches):
            mine = [r for r in rows if r["cell"] == cell and r["batch"] == batch]
            ax.plot([r["context"] for r in mine], [r["decode_tokens_per_sec"] for r in mine], marker="o", label=cell)
            ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title=f"batch {batch}")
        mine = [r for r in rows if r["cell"] == cell and r["batch"] == batches[0]]
        axes[0][-1].plot([r["context"] for r in mine], [r["state_bytes_per_sequence"] for r in mine], marker="o", label=cell)
    axes[0][-1].set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="state bytes per sequence", title="state")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--decode", type=int, default=128, help="tokens decoded per measurement (N)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-prefill-tokens", type=int, default=2**20)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "decode.csv")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "decode.png")
    args = parser.parse_args()
    rows = []
    print("| cell | batch | context | decode tokens/s | ms per step | state bytes / sequence |\n|---|---|---|---|---|---|")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:  # a row as it is measured: a run stopped early keeps its rows
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for cell in args.cells:
            for batch in args.batches:
                for context in args.contexts:
                    if batch * context > args.max_prefill_tokens:
                        continue
                    row = measure(cell, batch, context, args)
                    rows.append(row)
                    writer.writerow(row)
                    f.flush()
                    print(f"| {cell} | {batch} | {context:,} | {row['decode_tokens_per_sec']:,} | "
                          f"{row['ms_per_token_step']} | {row['state_bytes_per_sequence']:,} |", flush=True)
                    jax.clear_caches()
    try:
        plot(rows, args.plot)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[plots]')", file=sys.stderr)


if __name__ == "__main__":
    main()
