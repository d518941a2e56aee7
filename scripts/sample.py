"""Sample text from a trained data=text run: its newest checkpoint and its config, the prompt prefilled, then
`--length` bytes drawn one at a time (`rnnlab.decode.sample`: one compiled loop), printed.

    python scripts/sample.py RUN_DIR --prompt "ROMEO." --length 500 --temperature 0.8 [--top-k K] [--seed S]
        [--samples N]

`--temperature 0` decodes greedily; `--top-k K` draws among the K most likely bytes only (0: all). Each sample is
the prompt followed by the bytes drawn (UTF-8, an invalid byte shown as U+FFFD); with `--samples N` > 1 they
are separated by a line of dashes. Exit codes, each error one line on stderr: 0 done; 2 bad input (an option's
value, a run dir without a config or a checkpoint, a run that is not data=text).
"""

from __future__ import annotations

import argparse
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
from rnnlab import decode, steps, tasks, textdata  # noqa: E402
from rnnlab.checkpoint import Checkpointer  # noqa: E402
from rnnlab.models import build_model, initial_state  # noqa: E402

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """An option's value that cannot be used: one line naming the option and what is allowed."""


class Parser(argparse.ArgumentParser):
    """argparse, its errors one line (no usage) and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"sample: error: {message}\n")


def number(kind, low: float, what: str):
    """An argparse type: a `kind` >= low (ArgumentTypeError otherwise, naming what is allowed)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {what}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"got {text!r}, allowed: {what}")
        return value

    return parse


def parser() -> Parser:
    p = Parser(prog="sample.py", description="Sample text from a trained data=text run.")
    p.add_argument("run", type=Path, metavar="RUN_DIR", help="a train.py run dir (its .hydra/ and checkpoints/)")
    p.add_argument("--prompt", default="\n", help="the text the samples continue (default: a newline)")
    p.add_argument("--length", type=number(int, 1, "a whole number >= 1"), default=500, help="bytes to draw")
    p.add_argument("--temperature", type=number(float, 0.0, "a number >= 0"), default=1.0,
                   help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=number(int, 0, "a whole number from 0 to 256"), default=0,
                   help="draw among the K most likely bytes only (0: all)")
    p.add_argument("--seed", type=number(int, 0, "a whole number >= 0"), default=0)
    p.add_argument("--samples", type=number(int, 1, "a whole number >= 1"), default=1, help="samples drawn at once")
    return p


def load(run: Path) -> tuple[cfg.Config, tasks.Task, object, object, int]:
    """(config, task, model, parameters, step) of the run's newest checkpoint; BadInput naming RUN_DIR."""
    try:
        config = cfg.from_omegaconf(OmegaConf.load(run / ".hydra" / "config.yaml"))
    except FileNotFoundError:
        raise BadInput(f"argument RUN_DIR: no {run / '.hydra' / 'config.yaml'}: not a train.py run dir") from None
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
    checkpointer = Checkpointer(run / "checkpoints", 0, 1)
    try:
        restored = checkpointer.restore_latest(target)
    finally:
        checkpointer.close()
    if restored is None:
        raise BadInput(f"argument RUN_DIR: no checkpoint under {run / 'checkpoints'}")
    state, step, _ = restored
    return config, task, model, state.params, step


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
