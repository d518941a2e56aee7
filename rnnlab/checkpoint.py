"""Orbax checkpoints of the training state, and the preemption signal guard.

Orbax writes each step into a temporary directory and renames it into place only
when complete, so a crash or SIGKILL mid-save leaves the previous step intact; the
half-written temporary directory is ignored and cleaned up on the next start. Each
checkpoint holds two items: the train state, and the run record it was trained with (so
that the config travels with the weights and a resume can be checked against it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy, save_decision_policy

from rnnlab import exit_codes, files

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.json"  # the flat config the newest checkpoints were trained with
HISTORY_FILE = "config_history.json"  # the changes accepted on resume, with their step
STATE, RECORD = "state", "config"  # the Orbax items of a checkpoint: the train state and its run record


class CheckpointError(RuntimeError):
    """No checkpoint in the run dir could be restored."""

    exit_code = exit_codes.BAD_INPUT  # rnnlab.exit_codes.of_error


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only or failing storage)."""

    exit_code = exit_codes.CANNOT_WRITE


class Checkpointer:
    """Saves the unreplicated train state every `every` steps (0: only when forced), keeps `keep`."""

    def __init__(self, directory: Path, every: int, keep: int):
        self.directory = Path(directory).absolute()
        policy = (
            save_decision_policy.FixedIntervalPolicy(every)
            if every > 0
            else save_decision_policy.SpecificStepsPolicy(steps=())
        )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policy,
            preservation_policy=preservation_policy.LatestN(keep),
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._record: dict[str, Any] = {"run_config": {}, "config_history": []}
        self._closed = False
        self._failed = False  # a save failed: wait() removes its temporary dir

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def saved_record(self) -> tuple[int, dict[str, Any]] | None:
        """(step, run record) of the newest checkpoint whose record reads, or None if none does.

        A run record is {"run_config": flat config with the resolved device counts,
        "config_history": [{"step", "changes"}, ...]}: what the checkpoint was trained with."""
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                record = self._manager.restore(step, args=ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()}))[RECORD]
            except Exception as e:  # noqa: BLE001 - an unreadable record: try an older checkpoint's
                log.warning("checkpoint %s: its config cannot be read (%s)", self.directory / str(step), _first_line(e))
                continue
            if _is_record(record):
                return step, record
        return None

    def keep_record(self, record: dict[str, Any], write_files: bool = True) -> None:
        """The run record every later save carries; also written (by one process: `write_files`) as
        run_config.json and config_history.json, rewritten each start: a deleted or damaged one comes back."""
        self._record = record
        if not write_files:
            return
        files.write_json(self.directory / RUN_CONFIG_FILE, record["run_config"])
        history = self.directory / HISTORY_FILE
        if record["config_history"]:
            files.write_json(history, record["config_history"])
        else:
            history.unlink(missing_ok=True)

    def restore_latest(self, target: Any, at_most: int | None = None) -> tuple[Any, int, dict[str, Any]] | None:
        """(state, step, run record) from the newest restorable checkpoint (at step `at_most` or before, if
        given), or None if there is none.

        A checkpoint that fails to restore is reported with its path, renamed to
        `<step>.unreadable` (kept for inspection, invisible to Orbax, so the step can be
        saved again) and the next older one is tried. If none restores: CheckpointError,
        never a silent fresh start.
        """
        steps = sorted((s for s in self._manager.all_steps() if at_most is None or s <= at_most), reverse=True)
        failures = []
        for step in steps:
            path = self.directory / str(step)
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardRestore(target), RECORD: ocp.args.JsonRestore()}))
                if not _is_record(restored[RECORD]):
                    raise ValueError(f"its config record is not one: {str(restored[RECORD])[:100]}")
            except Exception as e:  # noqa: BLE001 - any failure to read this step means: try an older one
                log.warning("checkpoint %s cannot be restored (%s)", path, _first_line(e))
                failures.append(path)
                continue
            for bad in failures:
                bad.rename(bad.with_name(bad.name + ".unreadable"))
                log.warning("fell back from %s to step %d; kept it as %s.unreadable", bad, step, bad.name)
            if failures:
                self._manager.reload()
            return restored[STATE], step, restored[RECORD]
        if failures:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be restored (tried steps {', '.join(p.name for p in failures)}); "
                f"move them away or use a new hydra.run.dir"
            )
        return None

    def discard_after(self, step: int) -> None:
        """Delete the checkpoints after `step` (a population resumes every member at the newest step all of them
        saved; the later ones are written again as training reaches them)."""
        for later in sorted(s for s in self._manager.all_steps() if s > step):
            self._manager.delete(later)
            log.info("deleted checkpoint %s: training resumes from step %d", self.directory / str(later), step)

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Start an async save of `state` (unreplicated) at `step`; returns whether one started.
        CheckpointSaveError if this save, or the one still in flight, failed."""
        args = {STATE: ocp.args.StandardSave(state), RECORD: ocp.args.JsonSave(self._record)}
        try:
            return self._manager.save(step, args=ocp.args.Composite(**args), force=force)
        except Exception as e:  # noqa: BLE001 - Orbax reports I/O failures as ValueError, OSError, ...
            raise self._save_failed(e) from e

    def wait(self) -> None:
        """Until the save in flight is on disk; CheckpointSaveError if it failed. After a failed save
        its temporary dir is removed: it is garbage (the next start would remove it) and, on a full
        disk, the room that results.json needs."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(e) from e
        finally:
            if self._failed:
                for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)

    def _save_failed(self, error: Exception) -> CheckpointSaveError:
        self._failed = True
        text = str(error).strip()
        os_error = re.search(r"([A-Za-z][A-Za-z ,-]+) \[os_error_code='(\d+)'\]", text)  # tensorstore's wording
        reason = f"{os_error.group(1).strip()}, errno {os_error.group(2)}" if os_error else _first_line(error)
        return CheckpointSaveError(f"cannot save a checkpoint in {self.directory} ({reason}); the newest "
                                   f"saved one is step {self.latest_step()}")

    def close(self) -> None:
        """Idempotent, and quiet: it runs on failure paths, where the save error was already raised."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.close()
        except Exception as e:  # noqa: BLE001
            log.debug("closing the checkpoint manager: %s", e)


def saved_steps(directory: Path) -> set[int]:
    """The steps Orbax has completed in `directory` (a run dir's checkpoints/), read from its folder names
    without opening anything."""
    return {int(p.name) for p in Path(directory).glob("*") if p.name.isdigit() and p.is_dir()}


def _first_line(error: Exception) -> str:
    """An Orbax or tensorstore error's first line (they run to pages), or its type if it has no text."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _is_record(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("run_config"), dict)
            and isinstance(value.get("config_history"), list))


def requeue_signal() -> signal.Signals:
    """submitit's signal, which SLURM sends `signal_delay_s` before a job's time limit (and submitit on preemption):
    SIGUSR2, or the one SUBMITIT_PREEMPT_SIGNAL names (submitit's own setting)."""
    found = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper(), None)
    return found if isinstance(found, signal.Signals) else signal.SIGUSR2


# The handler that was there before the guard of submitit's signal that stopped training: called once the run has
# saved (`hand_off_stop`). One process trains one run at a time, and signal handlers are the process's.
_handoff: list[tuple[int, Any]] = []


def hand_off_stop() -> None:
    """After a run stopped by submitit's signal has saved its checkpoint and results.json: the signal's handler from
    before training, called now. Under hydra/launcher=slurm that is submitit's, which requeues the job and exits
    (SystemExit); the rerun resumes from the step just saved. Nothing where there was none (a plain train.py, a
    zoo job on SLURM: they end `preempted`, exit 75, as for SIGTERM)."""
    while _handoff:
        signum, handler = _handoff.pop()
        handler(signum, None)


class PreemptionGuard:
    """Turns SIGTERM, a first SIGINT and submitit's signal (`requeue_signal`: SLURM's time limit is near) into a
    flag the training loop polls between steps, and an evaluation between its lengths and between the chunks of a
    length run in segments (`steps.SegmentedEval`): the run saves and ends `preempted`. Where submitit had its own
    handler for its signal (hydra/launcher=slurm), that handler is called once the run has saved (`hand_off_stop`),
    so a job past its time limit loses no steps before submitit requeues it.

    A second SIGINT raises KeyboardInterrupt at once (two that arrive before Python runs the handler count as one:
    CPython keeps one pending flag per signal). Outside the main thread signal handlers cannot be installed, and the
    guard is inert.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("%s received: finishing the steps (or the eval's chunk) in progress, saving a checkpoint, then "
                    "exiting", name)
        self.requested = name
        previous = self._previous.get(signum)
        if signum == requeue_signal() and callable(previous):
            _handoff[:] = [(signum, previous)]

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for s in dict.fromkeys((*self.SIGNALS, requeue_signal())):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

