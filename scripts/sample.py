"""Sample text from a trained data=text run: its newest checkpoint and its config, the prompt prefilled, then
`--length` bytes drawn one at a time (`rnnlab.decode.sample`: one compiled loop), printed.

    python scripts/sample.py RUN_DIR --prompt "ROMEO." --length 500 --temperature 0.8 [--top-k K] [--seed S]
        [--samples N]

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
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rnnlab import config as cfg  # noqa: E402
from rnnlab import decode, exit_codes, steps, tasks, textdata  # noqa: E402
from rnnlab.checkpoint import Checkpointer, CheckpointError  # noqa: E402
from rnnlab.models import build_model, initial_state  # noqa: E402

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
    run = Path(text)
    if not (run / ".hydra" / "config.yaml").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a run dir of train.py (allowed: a dir holding "
                                         f".hydra/config.yaml and checkpoints/)")
    return run


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


def load(run: Path) -> tuple[cfg.Config, tasks.Task, object, object, int]:
    """(config, task, model, parameters, step) of the run's newest checkpoint; BadInput naming RUN_DIR."""
    try:
        composed = OmegaConf.load(run / ".hydra" / "config.yaml")
    except Exception as e:  # noqa: BLE001 - unreadable, or not YAML: not a run dir's config
        raise BadInput(f"argument RUN_DIR: cannot read {run / '.hydra' / 'config.yaml'} "
                       f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                       f"allowed: a train.py run dir") from None
    try:
        config = cfg.from_omegaconf(composed)
    except cfg.ConfigError as e:
        raise BadInput(f"argument RUN_DIR: {run}/.hydra/config.yaml: {e}") from None
    if config.data.task != "text":
        raise BadInput(f"argument RUN_DIR: {run} trained data={config.data.task}; allowed: a data=text run")
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    target = steps.create_train_state(jax.random.key(0), model, task.example_inputs(1), tx,
                                      carry_batch=config.batch_size)
    if not (run / "checkpoints").is_dir():
        raise BadInput(f"argument RUN_DIR: no checkpoint under {run / 'checkpoints'}")
    state, step = restore(run / "checkpoints", target)
    return config, task, model, state.params, step


def restore(directory: Path, target: object) -> tuple[object, int]:
    """(state, step) of the newest checkpoint under `directory` that restores into `target`; BadInput naming
    RUN_DIR if there is none, or none can be read. The checkpointer's warnings (a checkpoint that cannot be read)
    are held back: on failure the one line says it; on a fall back to an older one they are printed."""
    held: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = held.append
    logger = logging.getLogger("rnnlab.checkpoint")
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    allowed = "allowed: a run dir with a checkpoint of its config that can be read"
    try:
        try:
            checkpointer = Checkpointer(directory, 0, 1)
        except Exception as e:  # noqa: BLE001 - Orbax cannot even list them: as unreadable
            raise BadInput(f"argument RUN_DIR: cannot read the checkpoints under {directory} ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); {allowed}") from None
        try:
            restored = checkpointer.restore_latest(target)
        except CheckpointError as e:
            raise BadInput(f"argument RUN_DIR: {str(e).split('; ')[0]}; {allowed}") from None
        finally:
            checkpointer.close()
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    if restored is None:
        raise BadInput(f"argument RUN_DIR: no checkpoint under {directory}")
    for record in held:
        print(f"sample: warning: {record.getMessage()}", file=sys.stderr)
    state, step, _ = restored
    return state, step


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
    args = parser().parse_args(argv)
    if args.top_k > textdata.VOCAB_SIZE:
        parser().error(f"argument --top-k: got {args.top_k}, allowed: a whole number from 0 to {textdata.VOCAB_SIZE}")
    if not args.prompt:
        parser().error("argument --prompt: got '', allowed: text of at least one character")
    try:
        _, _, model, params, _ = load(args.run)
    except BadInput as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    texts = generate(model, params, args.prompt, args.length, args.temperature, args.top_k, args.seed, args.samples)
    print(("\n" + "-" * 40 + "\n").join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
