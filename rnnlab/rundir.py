"""What a run dir guarantees across processes and restarts: it can be written, one writer at a
time, and a resume that changes how training goes only where the user said so (the run record
each checkpoint carries says what it was trained with)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from rnnlab import tasks
from rnnlab.checkpoint import CheckpointError, Checkpointer, saved_steps
from rnnlab.config import Config, ConfigError, flatten
from rnnlab.files import exclusive_lock, read_json_object

# Keys that fix the shape or structure of the saved state: no resume can change them.
STRUCTURAL_KEYS = (
    "model.cell",
    "model.pattern",
    "model.hidden_dim",
    "model.num_layers",
    "model.scan_layers",
    "data.task",
    "optimizer.name",
)
# The task's widths, recorded beside the config: a task option that changes them (e.g. data.vocab_size)
# changes the parameter shapes, so it is refused like a structural key, without a list of such options.
WIDTH_KEYS = ("task.input_dim", "task.output_dim")
# Keys that cannot change a run's parameters: what is logged, evaluated, saved or traced and
# when, how many steps share a dispatch (the same steps either way), whether compiled programs are cached, and
# how processes meet.
# `device.num_devices` is compared as the count actually used (DEVICES_USED_KEY), not as written.
DEVICES_USED_KEY = "device.num_devices_used"  # the device count a run dir trains with (null resolved)
DISPATCH_USED_KEY = "device.steps_per_dispatch_used"  # recorded only
FREE_KEYS = ("imports", "log_every", "eval_every", "eval_batches", "eval_max_minutes", "data.eval_seq_lens", "data.eval_segment_len",
             "device.num_devices", "device.steps_per_dispatch", "device.compile_cache", DISPATCH_USED_KEY, *WIDTH_KEYS)  # the widths: checked apart
# `zoo.`: a group removed from the config (issue 88), still in the records of older run dirs: they resume.
FREE_GROUPS = ("checkpoint.", "profile.", "distributed.", "log.", "zoo.")
# Also free: a task's own options that change only its evaluation (`Task.eval_options`: data=text's
# data.eval_streams), found through the task registry (`is_free`).
# Keys added after run records existed, with the value a record written before them means: an older
# run dir resumes as the model it trained.
ADDED_KEYS = {"model.pattern": []}


# Keys that cannot change what a finished run's record says (`final_record`): how it logged, was traced,
# saved, cached its programs and met other processes.
RECORD_FREE_KEYS = ("device.compile_cache", "eval_max_minutes")
RECORD_FREE_GROUPS = ("checkpoint.", "profile.", "distributed.", "log.")


def recorded_config(config: Config) -> dict[str, Any]:
    """results.json's `config`: the flat config as JSON gives it back (lists, not tuples)."""
    return json.loads(json.dumps(flatten(config)))


def final_record(workdir: Path, config: Config) -> dict[str, Any] | None:
    """The results.json of a run dir whose run completed with `config` (but for the keys that cannot change its
    record: `RECORD_FREE_KEYS`) and, where it saves checkpoints, still holds its final one, so that running it again
    would change nothing; else None. A finished run's
    record is final: rerunning its command reports it as it stands and writes nothing."""
    record = read_json_object(Path(workdir) / "results.json")
    saved = record.get("config")
    if record.get("status") != "completed" or record.get("step") != config.steps or not isinstance(saved, dict):
        return None
    if not config.checkpoint.resume:
        return None  # the resume refusal says why
    if config.checkpoint.enabled and max(saved_steps(Path(workdir) / "checkpoints"), default=None) != config.steps:
        return None  # its final checkpoint is gone: the run resumes from the newest one left

    now = recorded_config(config)
    # Keys on one side only come from another rnnlab version (a key added since), not from the command line.
    shared = [k for k in saved.keys() & now.keys() if k not in RECORD_FREE_KEYS and not k.startswith(RECORD_FREE_GROUPS)]
    return record if all(saved[k] == now[k] for k in shared) else None


def is_free(key: str, task: str | None = None) -> bool:
    """Whether a resume may change `key` freely: it cannot change the run's parameters. `task`: the run's
    `data.task`, whose eval-only options (`tasks.eval_option_keys`) are free too."""
    return key in FREE_KEYS or key.startswith(FREE_GROUPS) or (task is not None and key in tasks.eval_option_keys(task))


def task_widths(task: Any) -> dict[str, int]:
    """The run record's WIDTH_KEYS of a `rnnlab.tasks.Task`."""
    return {"task.input_dim": task.input_dim, "task.output_dim": task.output_dim}


def run_record(config: Config, task: Any, num_devices: int | None, steps_per_dispatch: int | None) -> dict[str, Any]:
    """The run record's flat config: `config` with the task's widths (`task_widths`) and the resolved device
    count and dispatch size, as JSON gives it back (lists, not tuples), so that it compares equal to a saved one."""
    flat = {**flatten(config), **task_widths(task), DISPATCH_USED_KEY: steps_per_dispatch}
    if num_devices is not None:
        flat[DEVICES_USED_KEY] = num_devices
    return json.loads(json.dumps(flat))


def saved_run_config(checkpointer: Checkpointer, resume: bool) -> dict[str, Any] | None:
    """The flat config the newest checkpoint with a readable record was trained with; None if the run dir
    holds no checkpoint. A ConfigError if it holds one but `checkpoint.resume` is false; a CheckpointError
    if none has a readable record."""
    latest = checkpointer.latest_step()
    if latest is None:
        return None
    if not resume:
        raise ConfigError(
            f"key 'checkpoint.resume': false, but {checkpointer.directory} already holds step {latest}; "
            f"use a new hydra.run.dir, or checkpoint.resume=true to continue it"
        )
    saved = checkpointer.saved_record()
    if saved is None:
        raise CheckpointError(f"no checkpoint in {checkpointer.directory} can be restored (none has a readable "
                              f"config item: damaged, or written before checkpoints carried their config); "
                              f"move them away or use a new hydra.run.dir")
    return saved[1]["run_config"]


def resumed_record(saved: Mapping[str, Any], now: dict[str, Any], allowed: Sequence[str],
                   step: int) -> tuple[dict[str, Any], dict[str, list]]:
    """(the run record later checkpoints carry, the accepted changes) of a resume at `step` from a checkpoint
    whose record is `saved`: the config `now` (`run_record`), and the saved history with this resume's
    changes (`resume_changes`, which refuses those not `allowed`) added."""
    changes = resume_changes(saved["run_config"], now, allowed)
    history = saved["config_history"] + ([{"step": step, "changes": changes}] if changes else [])
    return {"run_config": now, "config_history": history}, changes


def resume_changes(saved: Mapping[str, Any], now: Mapping[str, Any], allowed: Sequence[str]) -> dict[str, list]:
    """{key: [saved value, new value]} for every trajectory key a resume changes, all of them in
    `allowed` (`checkpoint.allow_changes`); otherwise a ConfigError listing each change.

    `saved` and `now` are flat configs with DEVICES_USED_KEY resolved. A structural key is refused
    whatever `allowed` says. Keys missing on either side (a key added or removed by an rnnlab
    version) compare as None. A change of the task's widths (WIDTH_KEYS) is refused the same way,
    naming the data keys that changed."""
    saved = {**ADDED_KEYS, **saved}
    for key in STRUCTURAL_KEYS:
        if key in saved and saved[key] != now.get(key):
            raise ConfigError(
                f"key '{key}': this run dir was trained with {saved[key]!r}, now {now.get(key)!r}; "
                f"use the same value to resume, or a new hydra.run.dir"
            )
    for key in WIDTH_KEYS:
        if key in saved and saved[key] != now.get(key):
            causes = [k for k in sorted(set(saved) | set(now)) if k.startswith("data.") and saved.get(k) != now.get(k)]
            named = "".join(f", {k} {saved.get(k)!r} -> {now.get(k)!r}" for k in causes)
            raise ConfigError(
                f"key '{causes[0] if causes else key}': this run dir was trained with {key}={saved[key]!r}, now "
                f"{now.get(key)!r}{named}: the parameter shapes differ; use the same values to resume, or a new "
                f"hydra.run.dir"
            )
    task = now.get("data.task")  # the same as saved's (a structural key)
    changed = {key: [saved.get(key), now.get(key)] for key in sorted(set(saved) | set(now))
               if not is_free(key, task) and saved.get(key) != now.get(key)}
    refused = {key: values for key, values in changed.items() if _allow_name(key) not in allowed}
    if refused:
        listed = ", ".join(f"{_allow_name(k)} {a!r} -> {b!r}" for k, (a, b) in refused.items())
        names = ",".join(sorted({*allowed, *map(_allow_name, refused)}))
        raise ConfigError(
            f"key 'checkpoint.allow_changes': resuming changes {listed}; accept with "
            f"checkpoint.allow_changes=[{names}] (recorded in checkpoints/config_history.json), "
            f"or use the saved values, or a new hydra.run.dir"
        )
    return changed


def _allow_name(key: str) -> str:
    """The name `checkpoint.allow_changes` accepts a change under (the device count by its config key)."""
    return "device.num_devices" if key == DEVICES_USED_KEY else key


class RunDirUnwritable(OSError):
    """The run dir cannot be created or written (train.py: exit 74, as for a run dir that fails mid-run)."""


def check_writable(workdir: Path) -> None:
    """Create the run dir if it is missing; RunDirUnwritable if a file cannot be written there."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test.{os.getpid()}"  # per process: several may share the run dir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirUnwritable(f"key 'hydra.run.dir': {workdir} is not writable ({e.strerror or e}); choose "
                               "another hydra.run.dir") from None


class RunDirBusy(ConfigError):
    """Another live process holds the run dir's lock."""


class RunDirLock:
    """An exclusive `flock` on `<run dir>/.rnnlab.lock.<process index>`, held for the run's life.

    The OS releases it when the process ends, SIGKILL included, so it never goes stale. The
    processes of one multi-process run each take their own index; a second run on the same dir
    collides on every index. The file names the holder (pid and host) for the message."""

    def __init__(self, workdir: Path, process_index: int = 0):
        self.path = Path(workdir) / f".rnnlab.lock.{process_index}"
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        fd, who = exclusive_lock(self.path, os.O_NOFOLLOW)
        if fd is None:
            raise RunDirBusy(
                f"run dir {self.path.parent} is in use by {who} (lock {self.path.name}); wait for that run "
                f"to end, or choose another hydra.run.dir"
            )
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (deleting it would race a new holder)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
