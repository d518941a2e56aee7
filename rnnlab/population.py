"""The member axis: the runs of a grid that differ only in their `steps.Hyperparameters` values (the lr, the seed,
...) trained as one program (`rnnlab.trainer.train_population`), each member reporting, saving and resuming exactly
as its own run would (its run dir, results.json, TensorBoard run and checkpoints). A run alone is a population of
one (`rnnlab.trainer.train_and_evaluate`): its member axis is squeezed (`steps.over_members`), so its program is its
run's own.

The train state is a `steps.PopulationState` (the members' states stacked, and which still train); every step
`jax.vmap`s the run's step over the members inside the data-parallel map, so the member axis sits beside the
device axis (`member_axis`, the `Program` the loop trains). The loop talks to a `PopulationReporter` and a
`PopulationCheckpointer`, which hand each member's share to that member's own `Reporter` and `Checkpointer`. A
member whose loss or gradient norm is not finite stops (on the device its updates are masked; on the host its run
ends as "diverged") while the others go on; so does a member whose save fails ("failed").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import jax

from rnnlab import config as cfg
from rnnlab import memory
from rnnlab.checkpoint import Checkpointer, CheckpointSaveError
from rnnlab.report import EXAMPLES, NonFiniteLossError, Reporter
from rnnlab.setup import Setup
from rnnlab.steps import Members, PopulationState, StepFunctions, make_step_functions

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


@dataclasses.dataclass(frozen=True)
class Program:
    """What the loop trains (`rnnlab.trainer._train_members`): the step functions, the replicated state, the
    reporter and checkpointer the loop talks to (the members' adapters), the memory check of the
    compiled dispatch (XLA's memory analysis in; OutOfMemoryError out), and `ended(k)`: (the error that ended
    member k while the others trained on, the step where it ended), (None, None) for a member that did not."""

    fns: StepFunctions
    state: Any
    reporter: PopulationReporter
    saver: PopulationCheckpointer
    check_fits: Callable[[Any], None]
    ended: Callable[[int], tuple[BaseException | None, int | None]]


def step_functions(configs: Sequence[cfg.Config], anchor: Setup) -> StepFunctions:
    """The step functions of the members `configs` (a run alone: one), on the first member's plan `anchor`: the run's
    step over the member axis (`steps.Members.population`; a member axis of one squeezed, `steps.over_members`)."""
    return make_step_functions(configs[0], anchor.task, anchor.devices, anchor.steps_per_dispatch, EXAMPLES,
                               Members.population(configs))


def member_axis(fns: StepFunctions, configs: Sequence[cfg.Config], setups: Sequence[Setup], states: dict[int, Any],
                reporters: Sequence[Reporter], checkpointers: Sequence[Checkpointer], ids: Sequence[int],
                faults_raise: bool = False) -> Program:
    """The program of `ids`' members (a run alone is a population of one): their states stacked (`states`, emptied
    here: only the replicated stack stays on the devices) in a `PopulationState`, stepped by `fns`
    (`step_functions` of these members) with each member's `steps.Hyperparameters` as inputs, and the adapters that
    hand each member's share to its own reporter and checkpointer. `ids`: each member's index among the caller's,
    for `speaking_for`; `faults_raise`: a run alone's (`PopulationReporter`). OutOfMemoryError if the stacked states
    cannot fit."""
    first, anchor = configs[0], setups[0]
    reporter = PopulationReporter(reporters, ids, faults_raise)
    stacked = PopulationState.stack([states[i] for i in ids])
    states.clear()
    state_bytes = memory.tree_bytes(stacked.members)
    memory.check_fits(_states_named(len(ids)), state_bytes, state_bytes, anchor.devices, first)
    state = fns.dp.replicate(stacked)
    del stacked
    return Program(fns, state, reporter, PopulationCheckpointer(checkpointers, reporter),
                   lambda stats: memory.check_population_fits(stats, state_bytes, len(ids), anchor.devices, first),
                   lambda k: (reporter.ended[k], reporter.ended_at[k]))


def _states_named(count: int) -> str:
    return "the train state" if count == 1 else f"the train states of {count} members"


class PopulationReporter:
    """The `Reporter` interface the loop calls, for a population: each call goes to every member's reporter
    (with that member's share of the values, and its log lines marked as its: `speaking_for(ids[i])`), but to an
    ended member's no more. `ended[i]`: the error that ended member i while the others train on (a non-finite loss,
    a failed save; None while it trains), `ended_at[i]` the step where it ended. `ids`: each member's index among
    the caller's (the launcher's jobs), for `speaking_for`; by default 0, 1, ... `faults_raise`: a run alone
    (`rnnlab.trainer.train_and_evaluate`), whose end is its run's, said by the loop and train.py: no member's line
    about it, and a save that fails at the end raises as the run's would (the loop keeps an error it had first)."""

    def __init__(self, reporters: Sequence[Reporter], ids: Sequence[int] | None = None, faults_raise: bool = False):
        self.reporters, self.faults_raise = list(reporters), faults_raise
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
                if not self.faults_raise:  # a run alone's divergence is its run's end, said by the loop
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

    def log_final_eval(self, step: int, by_split: Sequence[dict[str, dict[str, float]]]) -> None:
        """Each member's evaluations made once at the last step (`StepFunctions.evaluate_final` of a population)."""
        for i, r in self._each():
            r.log_final_eval(step, by_split[i])

    def log_text(self, step: int, texts: dict[str, Sequence[str]]) -> None:
        """Each member's text summaries: every value one text per member (`StepFunctions.samples` of a population)."""
        for i, r in self._each():
            r.log_text(step, {name: each[i] for name, each in texts.items()})

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
        if reporter.ended[i] is None and not reporter.faults_raise:  # a run alone's: its run's end, said there
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
                    if not ended and self._reporter.faults_raise:
                        raise  # a run alone's: the loop keeps the error that stopped it, if it had one
                    if not ended:
                        self._failed(i, e, self._step, stop=False)  # the loop is over: nothing to stop
