"""Orbax checkpoints of the training state, and the preemption signal guard.

Orbax writes each step into a temporary directory and renames it into place only
when complete, so a crash or SIGKILL mid-save leaves the previous step intact; the
half-written temporary directory is ignored and cleaned up on the next start.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any, Mapping

import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy, save_decision_policy

from rnnlab import files
from rnnlab.config import ConfigError

log = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.json"
# Config keys that fix the shape or structure of the saved state: resuming with another
# value cannot work, so it is refused by name before Orbax sees mismatched arrays.
STRUCTURAL_KEYS = (
    "model.cell",
    "model.hidden_dim",
    "model.num_layers",
    "model.scan_layers",
    "data.task",
    "optimizer.name",
)


class CheckpointError(RuntimeError):
    """No checkpoint in the run dir could be restored."""


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

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def check_compatible(self, flat_config: Mapping[str, Any]) -> None:
        """Refuse to resume with a config whose structural keys differ from the saved run's."""
        path = self.directory / RUN_CONFIG_FILE
        if not path.exists():
            return
        saved = json.loads(path.read_text())
        for key in STRUCTURAL_KEYS:
            if key in saved and saved[key] != flat_config.get(key):
                raise ConfigError(
                    f"key '{key}': this run dir was trained with {saved[key]!r}, now {flat_config.get(key)!r}; "
                    f"use the same value to resume, or a new hydra.run.dir (or checkpoint.resume=false there)"
                )

    def saved_run_config(self) -> dict[str, Any]:
        """The flat config this run dir was first trained with ({} if none was recorded)."""
        return files.read_json_object(self.directory / RUN_CONFIG_FILE)

    def write_run_config(self, flat_config: Mapping[str, Any]) -> None:
        """Record the config that this run dir's checkpoints are trained with."""
        files.write_json(self.directory / RUN_CONFIG_FILE, dict(flat_config))

    def restore_latest(self, target: Any) -> tuple[Any, int] | None:
        """(state, step) from the newest restorable checkpoint, or None if there is none.

        A checkpoint that fails to restore is reported with its path, renamed to
        `<step>.unreadable` (kept for inspection, invisible to Orbax, so the step can be
        saved again) and the next older one is tried. If none restores: CheckpointError,
        never a silent fresh start.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        failures = []
        for step in steps:
            path = self.directory / str(step)
            try:
                state = self._manager.restore(step, args=ocp.args.StandardRestore(target))
            except Exception as e:  # noqa: BLE001 - any failure to read this step means: try an older one
                log.warning("checkpoint %s cannot be restored (%s)", path, str(e).splitlines()[0][:300])
                failures.append(path)
                continue
            for bad in failures:
                bad.rename(bad.with_name(bad.name + ".unreadable"))
                log.warning("fell back from %s to step %d; kept it as %s.unreadable", bad, step, bad.name)
            if failures:
                self._manager.reload()
            return state, step
        if failures:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be restored (tried steps {', '.join(p.name for p in failures)}); "
                f"move them away or use a new hydra.run.dir"
            )
        return None

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Start an async save of `state` (unreplicated) at `step`; returns whether one started."""
        return self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


class PreemptionGuard:
    """Turns SIGTERM and a first SIGINT into a flag the training loop polls between steps.

    A second SIGINT raises KeyboardInterrupt at once. Outside the main thread signal
    handlers cannot be installed, and the guard is inert.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("%s received: finishing the steps in progress, saving a checkpoint, then exiting", name)
        self.requested = name

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

