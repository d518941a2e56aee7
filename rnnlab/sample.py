"""Sample text from a trained data=text run: its newest checkpoint and its config, the prompt prefilled, then
`--length` bytes drawn one at a time (`rnnlab.decode.sample`: one compiled loop), printed.

    python -m rnnlab.sample RUN_DIR --prompt "ROMEO." --length 500 --temperature 0.8 [--top-k K] [--seed S]
        [--samples N]

(`python scripts/sample.py ...` runs the same.)

`--temperature 0` decodes greedily; `--top-k K` draws among the K most likely bytes only (0: all). Each sample is
the prompt followed by the bytes drawn (UTF-8, an invalid byte shown as U+FFFD); with `--samples N` > 1 they
are separated by a line of dashes. `--length` is at most 1,000,000 bytes and `--samples` at most 1,024: one
compiled loop draws every byte, one at a time, with nothing to stop it between, and holds them all (on a 2-core
CPU 10 µs a byte at hidden_dim=8, 0.5 ms at an LSTM of 2 x 512: a million take 10 s to 10 min). Exit codes,
each error one line on stderr: 0 done; 2 bad input (an option's value, a RUN_DIR that is not a train.py run
dir, holds no checkpoint or none that can be read, a run that is not data=text).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rnnlab import decode, exit_codes, textdata, trained
from rnnlab.models import initial_state

EXIT_BAD_INPUT = exit_codes.BAD_INPUT
# One compiled loop draws every byte of every sample, one step at a time, and holds them (and a key per step)
# until the end: nothing can stop it between, so `--length` and `--samples` are bounded where it still ends in
# minutes on a CPU (2 cores: 10 µs a byte at hidden_dim=8, 0.5 ms at an LSTM of 2 x 512) and in memory of no account.
MAX_LENGTH = 1_000_000
MAX_SAMPLES = 1_024


class BadInput(Exception):
    """An option's value that cannot be used: one line naming the option and what is allowed."""


class Parser(argparse.ArgumentParser):
    """argparse, its errors one line (no usage) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"sample: error: {message}\n")


def number(kind, low: float, what: str, high: float | None = None):
    """An argparse type: a `kind` from low to `high` (None: no bound) (ArgumentTypeError otherwise, naming what
    is allowed)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {what}") from None
        if not value >= low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {what}")
        return value

    return parse


def run_dir(text: str) -> Path:
    """RUN_DIR: a train.py run dir (a directory holding .hydra/config.yaml)."""
    try:
        return trained.require_run_dir(text)
    except trained.RunError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> Parser:
    p = Parser(prog="sample.py", description="Sample text from a trained data=text run.")
    p.add_argument("run", type=run_dir, metavar="RUN_DIR", help="a train.py run dir (its .hydra/ and checkpoints/)")
    p.add_argument("--prompt", default="\n", help="the text the samples continue (default: a newline)")
    p.add_argument("--length", type=number(int, 1, f"a whole number from 1 to {MAX_LENGTH:,} (bytes drawn one at a "
                                                   f"time in one loop that cannot be stopped: on a CPU a million "
                                                   f"take 10 s to 10 min)", MAX_LENGTH),
                   default=500, help=f"bytes to draw (1 .. {MAX_LENGTH:,})")
    p.add_argument("--temperature", type=number(float, 0.0, "a number >= 0"), default=1.0,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=number(int, 0, "a whole number from 0 to 256"), default=0,
                   help="draw among the K most likely bytes only (0: all)")
    p.add_argument("--seed", type=number(int, 0, "a whole number >= 0"), default=0)
    p.add_argument("--samples", type=number(int, 1, f"a whole number from 1 to {MAX_SAMPLES:,}", MAX_SAMPLES),
                   default=1, help=f"samples drawn at once (1 .. {MAX_SAMPLES:,})")
    return p


def load(run: Path) -> trained.TrainedRun:
    """The run at its newest checkpoint (`trained.load_run`); BadInput naming RUN_DIR if it cannot be loaded or is
    not a data=text run (checked before anything is restored)."""
    try:
        config = trained.read_config(run)
        if config.data.task != "text":
            raise BadInput(f"argument RUN_DIR: {run} trained data={config.data.task}; allowed: a data=text run")
        return trained.load_run(run)
    except trained.RunError as e:
        raise BadInput(f"argument RUN_DIR: {e}") from None


def generate(model, params, prompt: str, length: int, temperature: float, top_k: int, seed: int,
             samples: int = 1) -> list[str]:
    """`samples` continuations of `prompt` by `length` bytes each, as text (prompt included)."""
    ids = textdata.encode(prompt)
    key = jax.random.key(seed)
    first_key, rest_key = jax.random.split(key)
    prompt_ids = jnp.asarray(np.broadcast_to(ids, (samples, len(ids))))
    logits, state = decode.prefill(model, params, prompt_ids, initial_state(model, samples))
    first = decode.choose(logits[:, -1], first_key, temperature, top_k)
    tokens, _ = decode.sample(model, params, state, first, length, rest_key, temperature, top_k)
    return [prompt + textdata.decode(row) for row in np.asarray(tokens)]


def main(argv: list[str] | None = None) -> int:
    # On the CPU unless JAX_PLATFORMS says otherwise, set before JAX starts a backend (importing this module
    # sets nothing)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args = parser().parse_args(argv)
    if args.top_k > textdata.VOCAB_SIZE:
        parser().error(f"argument --top-k: got {args.top_k}, allowed: a whole number from 0 to {textdata.VOCAB_SIZE}")
    if not args.prompt:
        parser().error("argument --prompt: got '', allowed: text of at least one character")
    try:
        run = load(args.run)
    except BadInput as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in run.warnings:  # an older checkpoint restored: the newer ones' failures
        print(f"sample: warning: {warning}", file=sys.stderr)
    texts = generate(run.model, run.params, args.prompt, args.length, args.temperature, args.top_k, args.seed,
                     args.samples)
    print(("\n" + "-" * 40 + "\n").join(texts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
