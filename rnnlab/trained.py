"""A trained run, one call away: `load_run(run_dir)` reads a train.py run dir's composed config
(.hydra/config.yaml), builds its task and model, and restores its newest checkpoint (or a given step's) through
rnnlab's own `Checkpointer`, into what evaluation, sampling and decoding need.

    from rnnlab.models import initial_state
    from rnnlab.trained import load_run

    run = load_run("outputs/2026-01-01/12-00-00")                     # or load_run(run_dir, step=N)
    y, state = run.model.apply({"params": run.params}, x, state=initial_state(run.model, batch))
    run.evaluate(1024)                                                 # {"loss": ..., "accuracy": ...}

`python -m rnnlab.eval_long` and `python -m rnnlab.sample` load their runs with it. Every refusal is a `RunError`
of one line (no "argument RUN_DIR: " prefix: the command line tools add theirs): a dir that is not a run dir, a
config that cannot be read or is not one, no checkpoint, none that can be restored.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from omegaconf import OmegaConf

from rnnlab import config as cfg
from rnnlab import parallel, steps, tasks
from rnnlab.checkpoint import Checkpointer, CheckpointError, saved_steps
from rnnlab.models import build_model

CONFIG_FILE = Path(".hydra") / "config.yaml"  # what Hydra writes for train.py: the composed config
CHECKPOINTS = "checkpoints"
UNREADABLE = "allowed: a run dir with a checkpoint of its config that can be read"
RUNS_OWN = object()  # an option left at the run's own config's value


class RunError(Exception):
    """A run dir that cannot be loaded: one line, naming it and what is allowed."""


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """A run restored from its checkpoint. `config` is the run's own (as composed for train.py), `task` its
    `tasks.make_task(config.data)`, `model` its `models.build_model` for JAX's default backend, `state` the train
    state at `step` (a `CarryTrainState` for a task that carries its streams' state, data=text), `record` the run
    record that checkpoint carries (`checkpoint.Checkpointer.saved_record`), and `warnings` what the checkpointer
    said on the way (a newer checkpoint that could not be restored, so an older one was)."""

    run_dir: Path
    config: cfg.Config
    task: tasks.Task
    model: Any
    state: Any
    step: int
    record: dict
    warnings: tuple[str, ...] = ()

    @property
    def params(self) -> Any:
        """The model's parameters (`model.apply({"params": run.params}, ...)`)."""
        return self.state.params

    @functools.cached_property
    def _one_device(self) -> tuple[parallel.DataParallel, Any]:
        dp = parallel.DataParallel(jax.devices()[:1], "pmap")
        return dp, dp.replicate(self.state)

    def evaluate(self, length: int, sequences: int | None = None, segment_len: int | None = None,
                 max_minutes: float | None | object = RUNS_OWN, should_stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """The run's eval metrics at sequence length `length`, on one batch of `sequences` examples (default: its
        batch size) of the eval stream, by train.py's eval step on one device; in segments of `segment_len` steps
        (default: its `data.eval_segment_len`; None: whole) where the length is longer, `should_stop` asked between them
        (steps.EvalInterrupted when it says so). A length predicted past `max_minutes` (None: no limit; default: its
        `eval_max_minutes`) raises steps.EvalTooLongError. Each length compiles its own program."""
        config = self.config
        segment_len = segment_len or config.data.eval_segment_len
        config = dataclasses.replace(
            config, batch_size=sequences or config.batch_size, eval_batches=1,
            eval_max_minutes=config.eval_max_minutes if max_minutes is RUNS_OWN else max_minutes,
            data=dataclasses.replace(config.data, eval_segment_len=segment_len))
        dp, replicated = self._one_device
        task = self.task.with_seq_len(length)
        if segment_len and task.total_len > segment_len:
            evaluator = steps.make_segment_evaluator(config, task, config.batch_size, dp, segment_len)
            (metrics,) = evaluator.segments.run(replicated, evaluator.batches, should_stop)
        else:
            evaluator = steps.make_evaluator(config, task, config.batch_size, dp)
            metrics = evaluator.step(replicated, evaluator.batches[0])
        return {k: float(np.asarray(v).reshape(-1)[0]) for k, v in dp.to_host(metrics).items()}


def require_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` as a Path if it holds .hydra/config.yaml; RunError naming it as given otherwise."""
    path = Path(run_dir)
    if not (path / CONFIG_FILE).is_file():
        raise RunError(f"{str(run_dir)!r} is not a run dir of train.py (allowed: a dir holding .hydra/config.yaml "
                       f"and checkpoints/)")
    return path


def read_config(run_dir: str | Path) -> cfg.Config:
    """The run's composed config, checked as train.py checks it; RunError if it is not a run dir, the file cannot be
    read as YAML, or it is not a valid config."""
    run = require_run_dir(run_dir)
    try:
        composed = OmegaConf.load(run / CONFIG_FILE)
    except Exception as e:  # noqa: BLE001 - unreadable, or not YAML: not a run dir's config
        raise RunError(f"cannot read {run / CONFIG_FILE} ({type(e).__name__}: {_first_line(e)}); allowed: a train.py "
                       f"run dir") from None
    try:
        return cfg.from_omegaconf(composed)
    except cfg.ConfigError as e:
        raise RunError(f"{run}/{CONFIG_FILE}: {e}") from None


def load_run(run_dir: str | Path, step: int | None = None) -> TrainedRun:
    """The run in `run_dir` at its newest checkpoint that can be restored, or at `step` (which must be saved);
    RunError otherwise. As when training resumes, a newer checkpoint that cannot be restored is renamed
    `<step>.unreadable` and the next older one is tried (said in `TrainedRun.warnings`)."""
    config = read_config(run_dir)
    run = Path(run_dir)
    directory = run / CHECKPOINTS
    saved = saved_steps(directory) if directory.is_dir() else set()
    if not saved:
        raise RunError(f"no checkpoint under {directory}")
    if step is not None and step not in saved:
        raise RunError(f"no checkpoint of step {step} under {directory}; allowed: a saved step "
                       f"({', '.join(map(str, sorted(saved)))})")
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, None, task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    target = steps.create_train_state(jax.random.key(0), model, task.example_inputs(1), tx,
                                      carry_batch=config.batch_size if steps.carries_state(task) else 0)
    # The checkpointer's warnings (a checkpoint that cannot be read) are held back: on failure the one line says it;
    # on a fall back to an older one they are returned.
    held: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = held.append  # type: ignore[method-assign]
    logger = logging.getLogger("rnnlab.checkpoint")
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            checkpointer = Checkpointer(directory, 0, 1)
        except Exception as e:  # noqa: BLE001 - Orbax cannot even list them: as unreadable
            raise RunError(f"cannot read the checkpoints under {directory} ({type(e).__name__}: {_first_line(e)}); "
                           f"{UNREADABLE}") from None
        try:
            restored = checkpointer.restore_latest(target, at_most=step)
        except CheckpointError as e:
            raise RunError(f"{str(e).split('; ')[0]}; {UNREADABLE}") from None
        finally:
            checkpointer.close()
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    if restored is None:
        raise RunError(f"no checkpoint under {directory}")
    state, restored_step, record = restored
    if step is not None and restored_step != step:
        raise RunError(f"the checkpoint of step {step} under {directory} cannot be restored (kept as "
                       f"{step}.unreadable); {UNREADABLE}")
    return TrainedRun(run, config, task, model, state, restored_step, record,
                      tuple(r.getMessage() for r in held))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
