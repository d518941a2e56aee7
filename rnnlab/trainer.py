"""`train_and_evaluate`, the one call that runs a whole job, top to bottom: the backend, the plan
(a frozen `rnnlab.setup.Setup`), restore, compile (a frozen `rnnlab.steps.StepFunctions`), the
memory check, the loop (`rnnlab.loop`), results.json (`rnnlab.report.Reporter`).

Restore order: this run dir's newest restorable checkpoint, else a fresh initialisation.
The state is unreplicated (NumPy) for the checkpointer and replicated inside the loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from rnnlab import config as cfg
from rnnlab import compile_cache, memory, parallel
from rnnlab.checkpoint import Checkpointer
from rnnlab.loop import Outcome, train_loop
from rnnlab.models import count_params, summary_table
from rnnlab.report import EXAMPLES, NonFiniteLossError, Reporter
from rnnlab.provenance import utc_now
from rnnlab.rundir import RunDirLock, check_writable, final_record, resumed_record, run_record
from rnnlab.setup import Setup, plan
from rnnlab.steps import StepFunctions, make_step_functions

__all__ = ["NonFiniteLossError", "train_and_evaluate"]

log = logging.getLogger(__name__)


def train_and_evaluate(config: cfg.Config, workdir: Path | str, overrides: Sequence[str] = (),
                       varied: Sequence[str] | None = None) -> dict[str, Any]:
    """Train `config` in run dir `workdir` (resuming there if it holds checkpoints); returns results.json's dict.
    `overrides`: the command line's `key=value`s, which TensorBoard shows as text; `varied`: those that tell
    this job apart from the others of its sweep (None: all of them), registered first as HParams.

    Raises ConfigError for bad input (before anything compiles: a held run dir, a refused
    resume change, a step that cannot fit in memory included), CheckpointError if no
    checkpoint of the run dir can be restored, CheckpointSaveError or OSError if the run dir
    cannot be written, NonFiniteLossError if training diverges (with on_nonfinite=stop).
    Once training has started, results.json is written in every case the disk allows:
    `status` is "completed", "preempted" (SIGTERM/first SIGINT), "diverged", "aborted"
    (second SIGINT) or "failed", and `error` says why it stopped early. A run dir whose run completed with this
    config (`rundir.final_record`) is left as it is: its record is returned and nothing is written.
    """
    wall_start, started_utc = time.perf_counter(), utc_now()
    workdir = Path(workdir)
    record = final_record(workdir, config)
    if record is not None:
        log.info("%s already completed at step %d with this config: nothing to do (its record is %s)",
                 workdir, record["step"], workdir / "results.json")
        return record
    check_writable(workdir)
    cache = compile_cache.enable(config.device.compile_cache)
    devices = parallel.start_backend(config)
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(RunDirLock(workdir, jax.process_index()))
        checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint.every, config.checkpoint.keep)
        cleanup.callback(checkpointer.close)  # on any failure: Orbax's threads end, the process can exit
        try:
            setup = plan(config, workdir, devices, checkpointer)
            state, start_step = restore_or_init(setup, checkpointer)
            fns = make_step_functions(config, setup.task, setup.devices, setup.steps_per_dispatch, EXAMPLES)
            reporter = Reporter(setup, start_step, overrides, overrides if varied is None else varied,
                                started_utc=started_utc)
            cleanup.callback(reporter.close)
            num_params = count_params(state.params)
            state = fns.dp.replicate(state)
            memory.check_step_fits(compile_dispatch(fns, reporter, state, cache), setup.devices, config)
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, config) from None
            raise
        reporter.log_start(num_params)
        outcome = train_loop(config, fns, reporter, checkpointer, state, start_step)
        return finish_results(reporter, outcome, num_params, wall_start)


def restore_or_init(setup: Setup, checkpointer: Checkpointer, at_most: int | None = None) -> tuple[Any, int]:
    """(unreplicated state, its step), in the restore order above (at step `at_most` or before, if given).
    Either way the run record (config, accepted changes) that later checkpoints carry is kept; process 0
    writes the model summary first."""
    if setup.primary:
        summary = summary_table(setup.model, setup.example_inputs())
        (setup.workdir / "model_summary.txt").write_text(summary)
        print(summary)
    state = setup.init_state()
    now = run_record(setup.config, setup.task, len(setup.devices), setup.steps_per_dispatch)
    record = {"run_config": now, "config_history": []}
    restored = checkpointer.restore_latest(state, at_most)
    if restored is not None:
        state, step, saved = restored
        record, changes = resumed_record(saved, now, setup.config.checkpoint.allow_changes, step)
        log.info("resumed from %s at step %d", checkpointer.directory, step)
        if changes:
            log.warning("resuming at step %d with accepted changes: %s", step,
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    checkpointer.keep_record(record, write_files=setup.primary)
    return state, int(state.step)


def compile_dispatch(fns: StepFunctions, reporter: Reporter, state: Any, cache: compile_cache.CacheUse | None) -> Any:
    """Compile the train dispatch ahead of its first call (or load it from the persistent cache: the reporter
    is told which); returns XLA's memory analysis of it (for `memory.check_step_fits`: it must fit beside
    the already resident state). With several processes the first call compiles it (an ahead-of-time
    executable there rejects the processes' global arrays): None."""
    if jax.process_count() > 1:
        return None
    reporter.phase("compiling")
    started = time.perf_counter()
    hits, requests = (cache.hits, cache.requests) if cache else (0, 0)
    stats = fns.dispatch.compile(state)
    if cache is None or cache.requests == requests:
        how = "off"  # off, or JAX did not offer this program to its cache
    else:
        how = "hit" if cache.hits > hits else "miss"
    reporter.compiled(time.perf_counter() - started, how)
    return stats


def finish_results(reporter: Reporter, outcome: Outcome, num_params: int, wall_start: float) -> dict[str, Any]:
    """results.json whatever happened (as far as the disk allows); then the error that stopped the
    loop is raised, or the last line logged and the dict returned."""
    results = reporter.results(outcome.status, outcome.step, num_params, wall_start, outcome.error)
    reporter.finish(results)
    if outcome.error is not None:
        raise outcome.error
    reporter.log_end(results)
    return results
