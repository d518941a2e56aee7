"""The one orchestration of training: `train_and_evaluate` (a run alone) and `train_population` (a grid's runs as
one program with a member axis) are both `_train_members`, which sets the runs up, restores, compiles, checks
memory, trains (`rnnlab.loop`) and writes each run's results.json (`rnnlab.report.Reporter`). A run alone is a
population of one: the program the loop trains is the members' states stacked (`rnnlab.population.member_axis`,
whose member axis of one is squeezed: its run's own program). What differs is only who answers for a fault: a run
alone raises it, a population's member fails alone (`_member_fault`).

Restore order: each run dir's newest restorable checkpoint (a population's: the newest step all of its members
saved), else a fresh initialisation. The state is unreplicated (NumPy) for the checkpointer and replicated
inside the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax

from rnnlab import config as cfg
from rnnlab import compile_cache, memory, parallel
from rnnlab.checkpoint import CheckpointError, Checkpointer
from rnnlab.loop import train_loop
from rnnlab.models import count_params, summary_table
from rnnlab.population import Member, Program, check_members, member_axis, speaking_for, step_functions
from rnnlab.provenance import utc_now
from rnnlab.report import NonFiniteLossError, Reporter
from rnnlab.rundir import RunDirLock, check_writable, final_record, resumed_record, run_record
from rnnlab.setup import Setup, plan

__all__ = ["NonFiniteLossError", "Result", "train_and_evaluate", "train_population"]

log = logging.getLogger(__name__)

Result = tuple[dict[str, Any], BaseException | None]  # a run's results.json dict, and what ended it early


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
    member = Member(config, Path(workdir), tuple(overrides), None if varied is None else tuple(varied))
    [(results, error)] = _train_members([member], faults_raise=True)
    if error is not None:
        raise error
    return results


def train_population(members: Sequence[Member], *, locked: bool = False) -> list[Result]:
    """Train `members` as one program with a member axis; returns each member's (results.json dict, the error that
    ended it early or None), in order. Raises as `train_and_evaluate` does for what stops them all before training
    (bad input, a population that cannot fit: `memory.check_population_fits` says how many members would).

    A member's own fault fails that member alone, the others train on: before training (its run dir cannot be
    written or is held, its checkpoints cannot be restored or refuse the config: `_member_fault`), it is left out of
    the program, its results {"status": "failed", "error": ...} (its results.json is the caller's to write, as
    for a run `train_and_evaluate` refuses); a save that fails mid-run ends it as "failed" (its saves stop, its
    results.json says so). A member whose run completed with its config (`rundir.final_record`) is neither
    trained nor evaluated nor written: its record is returned as it stands. `locked`: the caller holds the members'
    run-dir locks (the launcher, which checks them before it touches anything)."""
    check_members(members)
    return _train_members(members, locked=locked, faults_raise=False)


def _train_members(members: Sequence[Member], *, locked: bool = False, faults_raise: bool = False) -> list[Result]:
    """The orchestration of `train_and_evaluate` (one member, whose faults raise: `faults_raise`) and
    `train_population` (each member's fault its own), the members as one program either way; returns each
    member's (results.json dict, the error that ended it early or None), in order."""
    wall_start, started_utc = time.perf_counter(), utc_now()
    outcome: dict[int, Result] = {}
    for i, m in enumerate(members):
        record = final_record(m.workdir, m.config)
        if record is not None:
            with speaking_for(i):
                log.info("%s already completed at step %d with this config: nothing to do (its record is %s)",
                         m.workdir, record["step"], m.workdir / "results.json")
            outcome[i] = (record, None)
        else:
            with speaking_for(i), _member_fault(i, outcome, faults_raise):
                check_writable(m.workdir)
    todo = [i for i in range(len(members)) if i not in outcome]
    if not todo:
        return [outcome[i] for i in range(len(members))]
    first = members[todo[0]].config
    cache = compile_cache.enable(first.device.compile_cache)
    devices = parallel.start_backend(first)
    with contextlib.ExitStack() as cleanup:
        try:
            setups, checkpointers = _plan_all(members, todo, devices, outcome, cleanup, locked, faults_raise)
            states, start_step = _restore_or_init_all(setups, checkpointers, outcome, faults_raise)
            # The step before the reporters: a step that cannot be built leaves no TensorBoard run. It is built again
            # for the others if a member's reporter cannot start (that member is left out).
            def fns_of(ids: list[int]) -> Any:
                return step_functions([members[i].config for i in ids], setups[ids[0]]) if ids else None

            ids = list(states)
            fns = fns_of(ids)
            reporters: dict[int, Reporter] = {}
            for i in list(states):
                m = members[i]
                with speaking_for(i), _member_fault(i, outcome, faults_raise):
                    reporters[i] = Reporter(setups[i], start_step, m.overrides,
                                            m.overrides if m.varied is None else m.varied,
                                            first=not reporters, started_utc=started_utc)
                    cleanup.callback(reporters[i].close)
            if list(reporters) != ids:
                ids = list(reporters)
                fns = fns_of(ids)
            if not ids:
                return [outcome[i] for i in range(len(members))]
            first = members[ids[0]].config
            num_params = count_params(states[ids[0]].params)
            program = member_axis(fns, [members[i].config for i in ids], [setups[i] for i in ids], states,
                                  [reporters[i] for i in ids], [checkpointers[i] for i in ids], ids, faults_raise)
            del states  # the members' own copies: only the replicated state stays on the devices
            program.check_fits(_compile_dispatch(program, cache))
        except Exception as e:
            if memory.is_out_of_memory(e):
                raise memory.out_of_memory_error(e, first) from None
            raise
        for i in ids:  # once nothing can refuse the program: a member ahead goes back to the others' step
            with speaking_for(i):
                checkpointers[i].discard_after(start_step)
        if len(ids) > 1:
            log.info("population of %d members (%s) as one program", len(ids),
                     ", ".join(" ".join(members[i].varied or members[i].overrides) or members[i].workdir.name
                               for i in ids))
        program.reporter.log_start(num_params)
        loop_outcome = train_loop(first, program.fns, program.reporter, program.saver, program.state, start_step)
        stopped = loop_outcome.error
        if not faults_raise and stopped is not None and not isinstance(stopped, (NonFiniteLossError, KeyboardInterrupt)) \
                and not any(program.ended(k)[0] is stopped for k in range(len(ids))):  # not one member's own error
            log.error("the population stopped: %s", stopped, exc_info=stopped)  # every member's log
        for k, i in enumerate(ids):
            own, ended_at = program.ended(k)
            error = own or loop_outcome.error
            if isinstance(own, NonFiniteLossError):
                status, step = "diverged", own.step
            elif own is not None:
                status, step = "failed", ended_at
            else:
                status, step = loop_outcome.status, loop_outcome.step
            with speaking_for(i):
                results = reporters[i].results(status, step, num_params, wall_start, error)
                reporters[i].finish(results)
                if error is None:
                    reporters[i].log_end(results)
            outcome[i] = (results, error)
        return [outcome[i] for i in range(len(members))]


def _plan_all(members: Sequence[Member], todo: Sequence[int], devices: Sequence[jax.Device],
              outcome: dict[int, Result], cleanup: contextlib.ExitStack, locked: bool,
              faults_raise: bool) -> tuple[dict[int, Setup], dict[int, Checkpointer]]:
    """Each member's run-dir lock (unless the caller holds them), checkpointer and plan, every one on the first
    member's devices; a member that cannot start fails alone (`_member_fault`)."""
    setups: dict[int, Setup] = {}
    checkpointers: dict[int, Checkpointer] = {}
    for i in todo:  # (a member whose run dir cannot be written is not among them)
        m = members[i]
        with speaking_for(i), _member_fault(i, outcome, faults_raise):
            if not locked:
                cleanup.enter_context(RunDirLock(m.workdir, jax.process_index()))
            c = Checkpointer(m.workdir / "checkpoints", m.config.checkpoint.every, m.config.checkpoint.keep)
            cleanup.callback(c.close)  # on any failure: Orbax's threads end, the process can exit
            checkpointers[i] = c
            anchor = next(iter(setups.values()), None)
            setup = plan(m.config, m.workdir, devices if anchor is None else list(anchor.devices), c)
            if anchor is not None:
                setup = dataclasses.replace(setup, devices=anchor.devices, device_note=anchor.device_note)
            setups[i] = setup
    return setups, checkpointers


@contextlib.contextmanager
def _member_fault(index: int, outcome: dict[int, Result], faults_raise: bool) -> Iterator[None]:
    """Within: what member `index` does alone. Unless its faults raise (a run alone's), an error there fails
    that member (recorded in `outcome`, logged in its own train.log: a traceback for what is not bad input) and is
    not raised; the caller leaves the member out."""
    if faults_raise:
        yield
        return
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


def _restore_or_init_all(setups: dict[int, Setup], checkpointers: dict[int, Checkpointer],
                         outcome: dict[int, Result], faults_raise: bool) -> tuple[dict[int, Any], int]:
    """({member: its unreplicated state}, their common step): every member restored at the newest step that all of
    them saved (after a SIGKILL between a population's saves, some have one more; the launcher groups members by
    their newest step, so this is the rare case), or all initialised. A member that cannot be restored (no readable
    checkpoint, a refused config change) fails alone (`_member_fault`) and the others go on without it.
    CheckpointError rather than a member's checkpoints left behind for a fresh start: train such members apart
    (hydra/launcher=basic)."""
    alive = [i for i in setups if i not in outcome]
    common = min((checkpointers[i].latest_step() or 0 for i in alive), default=0)
    while True:
        restored = {}
        for i in alive:
            with speaking_for(i), _member_fault(i, outcome, faults_raise):
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


def _compile_dispatch(program: Program, cache: compile_cache.CacheUse | None) -> Any:
    """Compile the train dispatch ahead of its first call (or load it from the persistent cache: the reporter
    is told which); returns XLA's memory analysis of it (for the program's memory check: it must fit beside
    the already resident state). With several processes the first call compiles it (an ahead-of-time
    executable there rejects the processes' global arrays): None."""
    if jax.process_count() > 1:
        return None
    program.reporter.phase("compiling")
    started = time.perf_counter()
    hits, requests = (cache.hits, cache.requests) if cache else (0, 0)
    stats = program.fns.dispatch.compile(program.state)
    if cache is None or cache.requests == requests:
        how = "off"  # off, or JAX did not offer this program to its cache
    else:
        how = "hit" if cache.hits > hits else "miss"
    program.reporter.compiled(time.perf_counter() - started, how)
    return stats
