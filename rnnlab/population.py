"""`train_population`: the runs of a grid that differ only in their `steps.Hyperparameters` values (the lr, the
seed, ...) trained as one program with a member axis, each member reporting, saving and resuming exactly as
its own run would (its run dir, results.json, TensorBoard run and checkpoints).

The train state is a `steps.PopulationState` (the members' states stacked, and which still train); every step
`jax.vmap`s the run's step over the members inside the data-parallel map, so the member axis sits beside the
device axis. The loop (`rnnlab.loop.train_loop`) is the one a single run uses: it talks to a
`PopulationReporter` and a `PopulationCheckpointer`, which hand each member's share to that member's own
`Reporter` and `Checkpointer`. A member whose loss or gradient norm is not finite stops (on the device its
updates are masked; on the host its run ends as "diverged") while the others go on. A rerun resumes every
member at the newest step that all of them saved.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from rnnlab import config as cfg
from rnnlab import compile_cache, memory, parallel
from rnnlab.checkpoint import CheckpointError, Checkpointer, CheckpointSaveError
from rnnlab.loop import train_loop
from rnnlab.models import count_params
from rnnlab.report import EXAMPLES, NonFiniteLossError, Reporter
from rnnlab.rundir import RunDirLock, check_writable
from rnnlab.setup import plan
from rnnlab.steps import PopulationState, make_step_functions, stack_hyperparameters
from rnnlab.trainer import compile_dispatch, restore_or_init

log = logging.getLogger("rnnlab.trainer")

# The config keys whose values a population's members may differ in: what the compiled step takes as inputs
# (`steps.Hyperparameters`) but the step count, which the members share with the loop.
MEMBER_KEYS = ("optimizer.lr", "seed", "optimizer.warmup_steps", "optimizer.end_lr_ratio", "optimizer.clip_norm",
               "optimizer.weight_decay", "optimizer.momentum", "optimizer.b1", "optimizer.b2")

_member: contextvars.ContextVar[int | None] = contextvars.ContextVar("rnnlab_population_member", default=None)


@contextlib.contextmanager
def speaking_for(index: int) -> Iterator[None]:
    """Log records made within are member `index`'s (`MemberFilter`); records made outside are every member's."""
    token = _member.set(index)
    try:
        yield
    finally:
        _member.reset(token)


class MemberFilter(logging.Filter):
    """Passes the records of member `index` and those of the whole population: for that member's train.log."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        return _member.get() in (None, self.index)


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a population: what `trainer.train_and_evaluate` would be called with."""

    config: cfg.Config
    workdir: Path
    overrides: tuple[str, ...] = ()  # the command line's key=values (TensorBoard's text)
    varied: tuple[str, ...] | None = None  # those that tell it apart in its sweep (None: all of them)


def population_key(config: cfg.Config, member_keys: Sequence[str] = MEMBER_KEYS) -> Any:
    """What must be equal for two runs to train as one population: the config with `member_keys` blanked,
    and the program's structure those keys can change (whether clipping and momentum are on)."""
    flat = cfg.flatten(config)
    return (tuple(sorted((k, repr(v)) for k, v in flat.items() if k not in member_keys)),
            config.optimizer.clip_norm > 0, bool(config.optimizer.momentum))


def check_members(members: Sequence[Member]) -> None:
    """ConfigError unless the members differ only in `MEMBER_KEYS` (and keep the program's structure)."""
    first = population_key(members[0].config)
    for m in members[1:]:
        if population_key(m.config) != first:
            a, b = cfg.flatten(members[0].config), cfg.flatten(m.config)
            differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in MEMBER_KEYS)
            raise cfg.ConfigError(
                f"key '{(differ or ['optimizer.clip_norm'])[0]}': the members of a population may differ only in "
                f"{', '.join(MEMBER_KEYS)} (clip_norm and momentum on or off alike); got {m.workdir} against "
                f"{members[0].workdir}")


def train_population(members: Sequence[Member]) -> list[tuple[dict[str, Any], BaseException | None]]:
    """Train `members` as one program; returns each member's (results.json dict, the error that ended it early or
    None), in order. Raises as `train_and_evaluate` does for what stops them all before training (bad input,
    a population that cannot fit: `memory.check_population_fits` says how many members would)."""
    wall_start = time.perf_counter()
    check_members(members)
    first = members[0].config
    for m in members:
        check_writable(m.workdir)
    cache = compile_cache.enable(first.device.compile_cache)
    devices = parallel.start_backend(first)
    with contextlib.ExitStack() as cleanup:
        for m in members:
            cleanup.enter_context(RunDirLock(m.workdir, jax.process_index()))
        checkpointers = [Checkpointer(m.workdir / "checkpoints", m.config.checkpoint.every, m.config.checkpoint.keep)
                         for m in members]
        for c in checkpointers:
            cleanup.callback(c.close)
        try:
            setups = []
            for i, (m, c) in enumerate(zip(members, checkpointers)):
                with speaking_for(i):
                    setup = plan(m.config, m.workdir, devices if not setups else list(setups[0].devices), c)
                setups.append(setup if not setups else dataclasses.replace(
                    setup, devices=setups[0].devices, device_note=setups[0].device_note))
            states, start_step = _restore_or_init_all(setups, checkpointers)
            hyper = stack_hyperparameters([m.config for m in members])
            fns = make_step_functions(first, setups[0].task, setups[0].devices, setups[0].steps_per_dispatch,
                                      EXAMPLES, hyper)
            reporters = []
            for i, (setup, m) in enumerate(zip(setups, members)):
                with speaking_for(i):
                    reporters.append(Reporter(setup, start_step, m.overrides,
                                              m.overrides if m.varied is None else m.varied, first=i == 0))
                cleanup.callback(reporters[-1].close)
            reporter = PopulationReporter(reporters)
            num_params = count_params(states[0].params)
            # One structure (member 0's: the members' optimizers are equal but for their numbers, which are inputs).
            stacked = jax.tree_util.tree_structure(states[0]).unflatten(
                [np.stack(leaves) for leaves in zip(*map(jax.tree_util.tree_leaves, states))])
            del states  # the members' own copies: only the replicated stack stays on the devices
            state_bytes = memory.tree_bytes(stacked)
            memory.check_fits(f"the train states of {len(members)} members", state_bytes, state_bytes, setups[0].devices,
                              first)
            state = fns.dp.replicate(PopulationState(stacked, np.ones(len(members), bool)))
            del stacked
            memory.check_population_fits(compile_dispatch(fns, reporter, state, cache), state_bytes, len(members),
                                         setups[0].devices, first)
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, first) from None
            raise
        for c in checkpointers:  # once nothing can refuse the population: a member ahead goes back to the others' step
            c.discard_after(start_step)
        log.info("population of %d members (%s) as one program", len(members),
                 ", ".join(" ".join(m.varied or m.overrides) or str(m.workdir.name) for m in members))
        reporter.log_start(num_params)
        outcome = train_loop(first, fns, reporter, PopulationCheckpointer(checkpointers, reporter.diverged),
                             state, start_step)
        if outcome.error is not None and not isinstance(outcome.error, (NonFiniteLossError, KeyboardInterrupt)):
            log.error("the population stopped: %s", outcome.error, exc_info=outcome.error)  # every member's train.log
        results = []
        for i, member_reporter in enumerate(reporters):
            error = reporter.diverged[i] or outcome.error
            status = "diverged" if reporter.diverged[i] else outcome.status
            step = error.step if isinstance(error, NonFiniteLossError) else None
            with speaking_for(i):
                out = member_reporter.results(status, step, num_params, wall_start, error)
                member_reporter.finish(out)
                if error is None:
                    member_reporter.log_end(out)
            results.append((out, error))
        return results


def _restore_or_init_all(setups: Sequence[Any], checkpointers: Sequence[Checkpointer]) -> tuple[list[Any], int]:
    """(each member's unreplicated state, their common step): every member restored at the newest step that all
    of them saved (after a SIGKILL between the members' saves, some have one more; the launcher groups members by
    their newest step, so this is the rare case), or all initialised. CheckpointError rather than a member's
    checkpoints left behind for a fresh start: train such members apart (hydra/launcher=basic)."""
    common = min(c.latest_step() or 0 for c in checkpointers)
    while True:
        restored = []
        for i, (setup, c) in enumerate(zip(setups, checkpointers)):
            with speaking_for(i):
                restored.append(restore_or_init(setup, c, common))
        steps = [step for _, step in restored]
        if len(set(steps)) == 1:
            break
        common = min(steps)  # a member's checkpoint at `common` did not restore: go back to what every one has
    fresh = [c.directory for c, step in zip(checkpointers, steps) if step == 0 and c.latest_step()]
    if fresh:
        raise CheckpointError(
            f"the members have no checkpoint step in common, and {fresh[0]} would start afresh; train its run apart "
            f"(hydra/launcher=basic) or move its checkpoints away")
    return [state for state, _ in restored], common


class PopulationReporter:
    """The `Reporter` interface the loop calls, for a population: each call goes to every member's reporter
    (with that member's share of the values, and its log lines marked as its: `speaking_for`), but to a
    diverged member's no more. `diverged[i]`: the error that ended member i (None while it trains)."""

    def __init__(self, reporters: Sequence[Reporter]):
        self.reporters = list(reporters)
        self.diverged: list[NonFiniteLossError | None] = [None] * len(reporters)

    def _each(self, alive_only: bool = True) -> Iterator[tuple[int, Reporter]]:
        for i, r in enumerate(self.reporters):
            if alive_only and self.diverged[i] is not None:
                continue
            with speaking_for(i):
                yield i, r

    def phase(self, text: str) -> None:
        self.reporters[0].phase(text)

    def compiled(self, seconds: float, cache: str = "off") -> None:
        for _, r in self._each(False):
            r.compiled(seconds, cache)

    def log_start(self, num_params: int) -> None:
        for _, r in self._each(False):
            r.log_start(num_params)

    def dispatching(self, first_step: int) -> None:
        for _, r in self._each():
            r.dispatching(first_step)

    def dispatched(self, step: int, steps: int, metrics: Any) -> None:
        for _, r in self._each():
            r.dispatched(step, steps, metrics)

    def add_rows(self, rows: Sequence[list[dict[str, float]]]) -> None:
        """Each member's rows (`StepFunctions.host_rows` of a population)."""
        for i, r in self._each():
            r.add_rows(rows[i])

    def _check(self, step: int) -> None:
        """Mark the members whose open window holds a non-finite step; if none is left, stop the population."""
        for i, r in self._each():
            try:
                r.check_finite(step)
            except NonFiniteLossError as e:
                self.diverged[i] = e
                r.stop_clock()  # its throughput: the steps it trained
                log.warning("member %d diverged at step %d; its updates stopped, the other members go on: %s",
                            i, e.step, e)
        if all(self.diverged):
            raise self.diverged[0]

    def check_finite(self, step: int) -> None:
        self._check(step)

    def close_window(self, step: int) -> None:
        self._check(step)
        for _, r in self._each():
            r.close_window(step)

    def paused(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for r in self.reporters:
            stack.enter_context(r.paused())
        return stack

    def log_eval(self, step: int, by_len: Sequence[dict[int, dict[str, float]]]) -> None:
        self._check(step)
        for i, r in self._each():
            r.log_eval(step, by_len[i])

    def log_examples(self, step: int, *per_member: Any) -> None:
        """Each member's eval examples (`StepFunctions.evaluate` of a population: one tuple or None per member)."""
        for i, r in self._each():
            if per_member[i] is not None:
                r.log_examples(step, *per_member[i])

    def log_param_stats(self, step: int, params: Any, grads: Any) -> None:
        for i, r in self._each():
            member = lambda tree: jax.tree_util.tree_map(lambda x: x[i], tree)  # noqa: E731
            r.log_param_stats(step, member(params), member(grads))

    def flush(self) -> None:
        for _, r in self._each(False):
            r.flush()

    def stop_clock(self) -> None:
        for _, r in self._each():
            r.stop_clock()

    def end_loop(self) -> None:
        for _, r in self._each(False):
            r.end_loop()


class PopulationCheckpointer:
    """The `Checkpointer` interface the loop calls, for a population: member i's state to its own checkpointer,
    a diverged member's never (as a lone run, it keeps the checkpoints from before it diverged)."""

    def __init__(self, checkpointers: Sequence[Checkpointer], diverged: Sequence[Any]):
        self.checkpointers, self._diverged = list(checkpointers), diverged

    def should_save(self, step: int) -> bool:
        return self.checkpointers[0].should_save(step)

    def save(self, step: int, state: PopulationState, force: bool = False) -> bool:
        started = False
        for i, c in enumerate(self.checkpointers):
            if self._diverged[i] is None:
                with speaking_for(i):
                    started |= c.save(step, jax.tree_util.tree_map(lambda x: x[i], state.members), force)
        return started

    def wait(self) -> None:
        errors = []
        for i, c in enumerate(self.checkpointers):
            with speaking_for(i):
                try:
                    c.wait()
                except CheckpointSaveError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
