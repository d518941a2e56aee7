"""`train_population`: the runs of a grid that differ only in their `steps.Hyperparameters` values (the lr, the
seed, ...) trained as one program with a member axis, each member reporting, saving and resuming exactly as
its own run would (its run dir, results.json, TensorBoard run and checkpoints).

The train state is a `steps.PopulationState` (the members' states stacked, and which still train); every step
`jax.vmap`s the run's step over the members inside the data-parallel map, so the member axis sits beside the
device axis. The loop (`rnnlab.loop.train_loop`) is the one a single run uses: it talks to a
`PopulationReporter` and a `PopulationCheckpointer`, which hand each member's share to that member's own
`Reporter` and `Checkpointer`. A member whose loss or gradient norm is not finite stops (on the device its
updates are masked; on the host its run ends as "diverged") while the others go on; so does a member whose save
fails ("failed"), and a member that cannot start (its run dir, its checkpoints, a refused resume) is left out of the
program. A rerun resumes every member at the newest step that all of them saved; a member whose run completed with
its config (`rundir.final_record`) is left as it is.
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
from rnnlab import compile_cache, memory, parallel, tasks
from rnnlab.checkpoint import CheckpointError, Checkpointer, CheckpointSaveError
from rnnlab.loop import train_loop
from rnnlab.models import count_params
from rnnlab.report import EXAMPLES, NonFiniteLossError, Reporter
from rnnlab.rundir import RunDirLock, check_writable, final_record
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


def check_task(config: cfg.Config) -> None:
    """ConfigError naming `hydra/launcher` if `config`'s task cannot train as a population's member: a task whose
    train state carries its streams' model state (`tasks.carries_state`: data=text) trains one run at a time.
    Asked of every job before the launcher writes anything (`rnnlab.population_launch.launch`)."""
    if tasks.carries_state(tasks.get_task(config.data.task)):
        raise cfg.ConfigError(f"key 'hydra/launcher': population, but data={config.data.task} trains one run at a "
                              f"time (its train state carries each stream's model state from step to step, which "
                              f"a member axis does not); allowed: hydra/launcher=basic or parallel")


def check_members(members: Sequence[Member]) -> None:
    """ConfigError unless the members' task can train as a population (`check_task`) and they differ only in
    `MEMBER_KEYS` (and keep the program's structure)."""
    check_task(members[0].config)
    first = population_key(members[0].config)
    for m in members[1:]:
        if population_key(m.config) != first:
            a, b = cfg.flatten(members[0].config), cfg.flatten(m.config)
            differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in MEMBER_KEYS)
            raise cfg.ConfigError(
                f"key '{(differ or ['optimizer.clip_norm'])[0]}': the members of a population may differ only in "
                f"{', '.join(MEMBER_KEYS)} (clip_norm and momentum on or off alike); got {m.workdir} against "
                f"{members[0].workdir}")


Result = tuple[dict[str, Any], BaseException | None]  # a member's results.json dict, and what ended it early


def train_population(members: Sequence[Member], *, locked: bool = False) -> list[Result]:
    """Train `members` as one program; returns each member's (results.json dict, the error that ended it early or
    None), in order. Raises as `train_and_evaluate` does for what stops them all before training (bad input,
    a population that cannot fit: `memory.check_population_fits` says how many members would).

    A member's own fault fails that member alone, the others train on: before training (its run dir cannot be
    written or is held, its checkpoints cannot be restored or refuse the config: `_member_fault`), it is left out of
    the program, its results {"status": "failed", "error": ...} (its results.json is the caller's to write, as
    for a run `train_and_evaluate` refuses); a save that fails mid-run ends it as "failed" (its saves stop, its
    results.json says so). A member whose run completed with its config (`rundir.final_record`) is neither
    trained nor evaluated nor written: its record is returned as it stands. `locked`: the caller holds the members'
    run-dir locks (the launcher, which checks them before it touches anything)."""
    wall_start = time.perf_counter()
    check_members(members)
    outcome: dict[int, Result] = {}
    for i, m in enumerate(members):
        record = final_record(m.workdir, m.config)
        if record is not None:
            with speaking_for(i):
                log.info("%s already completed at step %d with this config: left as it is", m.workdir, record["step"])
            outcome[i] = (record, None)
    todo = [i for i in range(len(members)) if i not in outcome]
    if not todo:
        return [outcome[i] for i in range(len(members))]
    first = members[todo[0]].config
    cache = compile_cache.enable(first.device.compile_cache)
    devices = parallel.start_backend(first)
    with contextlib.ExitStack() as cleanup:
        checkpointers: dict[int, Checkpointer] = {}
        setups: dict[int, Any] = {}
        try:
            for i in todo:
                m = members[i]
                with speaking_for(i), _member_fault(i, outcome):
                    check_writable(m.workdir)
                    if not locked:
                        cleanup.enter_context(RunDirLock(m.workdir, jax.process_index()))
                    c = Checkpointer(m.workdir / "checkpoints", m.config.checkpoint.every, m.config.checkpoint.keep)
                    cleanup.callback(c.close)
                    checkpointers[i] = c
                    anchor = next(iter(setups.values()), None)  # the first member's devices: every member's
                    setup = plan(m.config, m.workdir, devices if anchor is None else list(anchor.devices), c)
                    if anchor is not None:
                        setup = dataclasses.replace(setup, devices=anchor.devices, device_note=anchor.device_note)
                    setups[i] = setup
            states, start_step = _restore_or_init_all(setups, checkpointers, outcome)
            reporters: dict[int, Reporter] = {}
            for i in list(states):
                m = members[i]
                with speaking_for(i), _member_fault(i, outcome):
                    reporters[i] = Reporter(setups[i], start_step, m.overrides,
                                            m.overrides if m.varied is None else m.varied, first=not reporters)
                    cleanup.callback(reporters[i].close)
            ids = list(reporters)
            if not ids:
                return [outcome[i] for i in range(len(members))]
            first, anchor = members[ids[0]].config, setups[ids[0]]
            hyper = stack_hyperparameters([members[i].config for i in ids])
            fns = make_step_functions(first, anchor.task, anchor.devices, anchor.steps_per_dispatch, EXAMPLES, hyper)
            reporter = PopulationReporter([reporters[i] for i in ids], ids)
            num_params = count_params(states[ids[0]].params)
            # One structure (the first member's: the members' optimizers are equal but for their numbers, which are
            # inputs).
            stacked = jax.tree_util.tree_structure(states[ids[0]]).unflatten(
                [np.stack(leaves) for leaves in zip(*(jax.tree_util.tree_leaves(states[i]) for i in ids))])
            del states  # the members' own copies: only the replicated stack stays on the devices
            state_bytes = memory.tree_bytes(stacked)
            memory.check_fits(f"the train states of {len(ids)} members", state_bytes, state_bytes, anchor.devices,
                              first)
            state = fns.dp.replicate(PopulationState(stacked, np.ones(len(ids), bool)))
            del stacked
            memory.check_population_fits(compile_dispatch(fns, reporter, state, cache), state_bytes, len(ids),
                                         anchor.devices, first)
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, first) from None
            raise
        for i in ids:  # once nothing can refuse the population: a member ahead goes back to the others' step
            with speaking_for(i):
                checkpointers[i].discard_after(start_step)
        log.info("population of %d members (%s) as one program", len(ids),
                 ", ".join(" ".join(members[i].varied or members[i].overrides) or members[i].workdir.name
                           for i in ids))
        reporter.log_start(num_params)
        saver = PopulationCheckpointer([checkpointers[i] for i in ids], reporter)
        loop_outcome = train_loop(first, fns, reporter, saver, state, start_step)
        stopped = loop_outcome.error
        if stopped is not None and not isinstance(stopped, (NonFiniteLossError, KeyboardInterrupt)) \
                and not any(e is stopped for e in reporter.ended):  # not one member's own error
            log.error("the population stopped: %s", stopped, exc_info=stopped)  # every member's log
        for k, (i, member_reporter) in enumerate(zip(ids, reporter.reporters)):
            own = reporter.ended[k]
            error = own or loop_outcome.error
            if isinstance(own, NonFiniteLossError):
                status, step = "diverged", own.step
            elif own is not None:
                status, step = "failed", reporter.ended_at[k]
            else:
                status, step = loop_outcome.status, None
            with speaking_for(i):
                out = member_reporter.results(status, step, num_params, wall_start, error)
                member_reporter.finish(out)
                if error is None:
                    member_reporter.log_end(out)
            outcome[i] = (out, error)
        return [outcome[i] for i in range(len(members))]


@contextlib.contextmanager
def _member_fault(index: int, outcome: dict[int, Result]) -> Iterator[None]:
    """Within: what member `index` does alone. An error there fails that member (recorded in `outcome`, logged in its
    own train.log: a traceback for what is not bad input) and is not raised; the caller leaves the member out."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - this member's alone: the others train on
        if memory.is_out_of_memory(e):
            raise
        expected = isinstance(e, (cfg.ConfigError, CheckpointError))
        log.error("member %d cannot train, the other members go on: %s", index, _one_line(e),
                  exc_info=None if expected else e)
        outcome[index] = ({"status": "failed", "error": _one_line(e), "step": None}, e)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return line if isinstance(error, (cfg.ConfigError, CheckpointError)) else f"{type(error).__name__}: {line}"


def _restore_or_init_all(setups: dict[int, Any], checkpointers: dict[int, Checkpointer],
                         outcome: dict[int, Result]) -> tuple[dict[int, Any], int]:
    """({member: its unreplicated state}, their common step): every member restored at the newest step that all of
    them saved (after a SIGKILL between the members' saves, some have one more; the launcher groups members by
    their newest step, so this is the rare case), or all initialised. A member that cannot be restored (no readable
    checkpoint, a refused config change) fails alone (`_member_fault`) and the others go on without it.
    CheckpointError rather than a member's checkpoints left behind for a fresh start: train such members apart
    (hydra/launcher=basic)."""
    alive = [i for i in setups if i not in outcome]
    common = min((checkpointers[i].latest_step() or 0 for i in alive), default=0)
    while True:
        restored = {}
        for i in alive:
            with speaking_for(i), _member_fault(i, outcome):
                restored[i] = restore_or_init(setups[i], checkpointers[i], common)
        alive = list(restored)
        steps = {step for _, step in restored.values()}
        if len(steps) <= 1:
            break
        common = min(steps)  # a member's checkpoint at `common` did not restore: go back to what every one has
    fresh = [checkpointers[i].directory for i, (_, step) in restored.items()
             if step == 0 and checkpointers[i].latest_step()]
    if fresh:
        raise CheckpointError(
            f"the members have no checkpoint step in common, and {fresh[0]} would start afresh; train its run apart "
            f"(hydra/launcher=basic) or move its checkpoints away")
    return {i: state for i, (state, _) in restored.items()}, (steps.pop() if steps else 0)


class PopulationReporter:
    """The `Reporter` interface the loop calls, for a population: each call goes to every member's reporter
    (with that member's share of the values, and its log lines marked as its: `speaking_for(ids[i])`), but to an
    ended member's no more. `ended[i]`: the error that ended member i while the others train on (a non-finite loss,
    a failed save; None while it trains), `ended_at[i]` the step where it ended. `ids`: each member's index among
    the caller's (the launcher's jobs), for `speaking_for`; by default 0, 1, ..."""

    def __init__(self, reporters: Sequence[Reporter], ids: Sequence[int] | None = None):
        self.reporters = list(reporters)
        self.ids = list(range(len(self.reporters))) if ids is None else list(ids)
        self.ended: list[BaseException | None] = [None] * len(reporters)
        self.ended_at: list[int | None] = [None] * len(reporters)

    def _each(self, alive_only: bool = True) -> Iterator[tuple[int, Reporter]]:
        for i, r in enumerate(self.reporters):
            if alive_only and self.ended[i] is not None:
                continue
            with speaking_for(self.ids[i]):
                yield i, r

    def end_member(self, i: int, error: BaseException, step: int, stop: bool = True) -> None:
        """Member i stops here (its saves and lines stop; the program goes on computing it, unread); with `stop`,
        once none is left, the loop stops with the first one's error."""
        if self.ended[i] is None:
            self.ended[i], self.ended_at[i] = error, step
            with speaking_for(self.ids[i]):
                self.reporters[i].stop_clock()  # its throughput: the steps it trained
        if stop:
            self.stop_if_none_left()

    def stop_if_none_left(self) -> None:
        if all(e is not None for e in self.ended):
            raise self.ended[0]

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
                self.ended[i], self.ended_at[i] = e, e.step
                r.stop_clock()  # its throughput: the steps it trained
                log.warning("member %d diverged at step %d; its updates stopped, the other members go on: %s",
                            self.ids[i], e.step, e)
        self.stop_if_none_left()

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
    """The `Checkpointer` interface the loop calls, for a population: member i's state to its own checkpointer, an
    ended member's never (as a lone run, a diverged one keeps the checkpoints from before it diverged). A save of
    member i that fails (its disk, its checkpoints dir) ends member i alone as "failed"
    (`PopulationReporter.end_member`): its saves stop, the other members train and save on."""

    def __init__(self, checkpointers: Sequence[Checkpointer], reporter: PopulationReporter):
        self.checkpointers, self._reporter = list(checkpointers), reporter
        self._step = 0  # the step of the last save asked for

    def should_save(self, step: int) -> bool:
        return self.checkpointers[0].should_save(step)

    def _failed(self, i: int, error: CheckpointSaveError, step: int, stop: bool = True) -> None:
        reporter = self._reporter
        if reporter.ended[i] is None:
            with speaking_for(reporter.ids[i]):
                log.error("member %d: %s; its saves stopped, the other members go on", reporter.ids[i], error,
                          exc_info=error.__cause__ or error)
        reporter.end_member(i, error, step, stop)

    def save(self, step: int, state: PopulationState, force: bool = False) -> bool:
        started, self._step = False, step
        for i, c in enumerate(self.checkpointers):
            if self._reporter.ended[i] is None:
                with speaking_for(self._reporter.ids[i]):
                    try:
                        started |= c.save(step, jax.tree_util.tree_map(lambda x: x[i], state.members), force)
                    except CheckpointSaveError as e:
                        self._failed(i, e, step)
        return started

    def wait(self) -> None:
        """Until every member's save in flight is on disk; a member whose save failed ends as "failed" (raised only
        once no member is left)."""
        for i, c in enumerate(self.checkpointers):
            ended = self._reporter.ended[i] is not None
            with speaking_for(self._reporter.ids[i]):
                try:
                    c.wait()  # an ended member's too: a failed save's temporary dir is removed
                except CheckpointSaveError as e:
                    if not ended:
                        self._failed(i, e, self._step, stop=False)  # the loop is over: nothing to stop
