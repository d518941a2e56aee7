"""rnnlab's entry point: `python train.py [key=value ...]` or `python train.py -m ...` for sweeps.

Composes conf/ with Hydra, turns it into validated dataclasses and runs
`rnnlab.trainer.train_and_evaluate` in Hydra's run directory. Returns the final
eval loss so that optimising sweepers (Optuna) can minimise it.

Exit codes, each with one line on stderr: 0 done; 1 a bug (its traceback goes to train.log);
2 bad input (config, a run dir in use, a refused resume change, unreadable
checkpoints, a step that does not fit in memory, an eval length predicted past eval_max_minutes; a sweep dir
another sweep holds); 3 training diverged
(NaN/Inf); 74 the run dir or a sweep's dir cannot be written, at the start or mid-run (disk full, read-only:
the last checkpoint is intact);
75 preempted by SIGTERM/SIGINT (or submitit's SIGUSR2: a SLURM time limit) after saving a checkpoint
(rerun the same command to resume; under hydra/launcher=slurm submitit requeues the job);
130 aborted by a second SIGINT. No failure leaves the process waiting on a stuck thread.
"""

import argparse
import datetime
import functools
import hashlib
import logging
import os
import re
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

# hydra/launcher=population's plugin class: Hydra finds plugins in the `hydra_plugins` namespace only.
sys.path.append(str(Path(__file__).resolve().parent / "rnnlab" / "hydra_plugin_path"))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rnnlab.board import override_key
from rnnlab import exit_codes
from rnnlab.checkpoint import hand_off_stop
from rnnlab.config import Config, ConfigError, from_omegaconf
from rnnlab.exit_codes import ABORTED as EXIT_ABORTED  # the codes, defined once (rnnlab/exit_codes.py)
from rnnlab.exit_codes import BAD_INPUT as EXIT_BAD_INPUT
from rnnlab.exit_codes import BUG as EXIT_BUG
from rnnlab.exit_codes import CANNOT_WRITE as EXIT_CANNOT_WRITE
from rnnlab.exit_codes import PREEMPTED as EXIT_PREEMPTED
from rnnlab.metrics import JobFailed, write_failure
from rnnlab.rundir import RunDirBusy
from rnnlab.sweep_status import SWEPT_KEYS_ENV, SweepRefused, job_output_to, varied_overrides

# Importing orbax (absl) calls logging.basicConfig(); Hydra configures logging itself, and with both
# every line of `--info` and of Hydra's own messages printed twice.
for _handler in list(logging.root.handlers):
    logging.root.removeHandler(_handler)

SWEEP_DIR_ENV = "RNNLAB_SWEEP_DIR"  # run_cli -> the launcher and its workers: the sweep dir (conf/config.yaml)
STUCK_THREAD_SECONDS = 10.0  # how long an exit waits for other threads (Orbax's) before leaving without them


_GROUPS_HELP: dict[tuple, str] = {}  # config_groups_help's text by (search path, width); a dict, not an lru_cache:
# Hydra's joblib launcher pickles this module's resolvers by value into its workers, where train.py is not __main__


def config_groups_help(width: int = 100) -> str:
    """`--help`'s config groups (conf/hydra/help/rnnlab.yaml), each with its options as Hydra finds
    them: Hydra's own $APP_CONFIG_GROUPS puts a group on one line, which the presets outgrow. Hydra
    resolves it at every composition: kept per search path (listing the groups was 40% of a compose)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    key = (tuple(source.full_path() for source in loader.get_sources()), width)
    if key not in _GROUPS_HELP:
        _GROUPS_HELP[key] = "\n".join(
            textwrap.fill(", ".join(sorted(loader.get_group_options(group, ObjectType.CONFIG))), width,
                          initial_indent=f"  {group + ':':<16}  ", subsequent_indent=" " * 20, break_on_hyphens=False)
            for group in sorted(loader.list_groups("")) if group != "hydra")
    return _GROUPS_HELP[key]


def swept_keys(args: list[str]) -> list[str]:
    """The keys the command line's sweep overrides vary (`model=rnn,gru`, `x=range(1,4)`, `x=choice(..)`)."""
    return [o.key_or_group for o in parsed_overrides(args) if o.is_sweep_override()]


def parsed_overrides(args: list[str]) -> list:
    """The command line's overrides as Hydra parses them, or [] for a malformed one (Hydra reports it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(_HYDRA_FLAGS.parse_known_args(args)[0].overrides)
    except (HydraException, argparse.ArgumentError):
        return []


def _hydra_flags() -> argparse.ArgumentParser:
    """hydra.main's command line, as far as it tells flags from overrides: its flags that take a value (`-cd DIR`,
    `--cfg job`, `--info [what]`); the others take none, so that `parse_known_args` leaves them aside. Hydra's own
    parser is private (hydra._internal); tests/test_sweeps.py holds this one to it."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("overrides", nargs="*")
    for flags in (("--cfg", "-c"), ("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"),
                  ("--config-dir", "-cd"), ("--experimental-rerun",)):
        parser.add_argument(*flags)
    parser.add_argument("--info", "-i", nargs="?",
                        choices=["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"])
    return parser


_HYDRA_FLAGS = _hydra_flags()


MAX_SWEEP_NAME = 80  # characters of a sweep dir's name made from overrides; longer ones end in a hash


def sweep_home(args: list[str], now: datetime.datetime) -> str:
    """The sweep dir of a command that does not name one (`hydra.sweep.dir=...`): `multirun/<preset>` for
    `experiment=<preset>`, and below it a dir named after the command's other overrides if it has any
    (launcher keys left out), so that rerunning the same command resumes its jobs; else
    `multirun/<date>/<time>`. An Optuna study (`hparams_search`) keeps its time: its trials are drawn anew."""
    overrides = parsed_overrides(args)
    preset = stable_preset(overrides)
    if preset is None:
        return f"multirun/{now:%Y-%m-%d}/{now:%H-%M-%S}"
    rest = sorted(o.input_line for o in overrides
                  if o.key_or_group != "experiment" and not o.key_or_group.startswith(("hydra/", "hydra.")))
    if not rest:
        return f"multirun/{preset}"
    name = re.sub(r"[^A-Za-z0-9._=,+~-]", "_", ",".join(rest))
    if len(name) > MAX_SWEEP_NAME:
        name = f"{name[:MAX_SWEEP_NAME - 9]}-{hashlib.sha1(','.join(rest).encode()).hexdigest()[:8]}"
    return f"multirun/{preset}/{name}"


def stable_preset(overrides: list) -> str | None:
    """The `experiment=<preset>` that gives a sweep its stable dir (`sweep_home`), or None."""
    if any(o.key_or_group == "hparams_search" for o in overrides):
        return None
    return next((o.value() for o in overrides if o.key_or_group == "experiment" and isinstance(o.value(), str)), None)


_sweep_dir_used: list[str] = []  # the sweep dir this process resolved (the launcher resolves it first)


def in_sweep(args: list[str] | None = None) -> bool:
    """Whether this process runs a sweep (`-m`): it resolved conf/config.yaml's sweep dir, or the command line
    asks for one (with `hydra.sweep.dir=...` given, nothing resolves it)."""
    args = sys.argv[1:] if args is None else args
    return bool(_sweep_dir_used) or any(a in ("-m", "--multirun") for a in args)


def sweep_dir() -> str:
    """conf/config.yaml's hydra.sweep.dir: what run_cli put in SWEEP_DIR_ENV (`sweep_home`), which every
    worker of a launcher inherits, so that all resolve the same dir."""
    home = os.environ.get(SWEEP_DIR_ENV) or sweep_home(sys.argv[1:], datetime.datetime.now())
    if not _sweep_dir_used:
        _sweep_dir_used.append(home)
    return home


def resume_command(args: list[str]) -> str:
    """The command that resumes this process's interrupted sweep: the same one, naming the sweep dir
    if it was timestamped (a rerun would get a new time)."""
    import shlex

    command = ["python", "train.py", *args]
    named = any(a.startswith("hydra.sweep.dir=") for a in args)
    home = _sweep_dir_used[0] if _sweep_dir_used else None
    if not named and (home is None or stable_preset(parsed_overrides(args)) is None):
        command.append(f"hydra.sweep.dir={home or '<its sweep dir>'}")
    return shlex.join(command)


def job_dirname(*, _root_: DictConfig) -> str:
    """A sweep job's dir name after its number (conf/config.yaml): its `varied_overrides`, sorted and
    joined as Hydra's override_dirname (`hidden_dim=64,model=gru`), so that TensorBoard's run names stay
    short; the overrides every job shares are in the sweep dir's multirun.yaml."""
    naming = _root_.hydra.job.config.override_dirname
    lines = sorted(o for o in varied_overrides(_root_.hydra) if override_key(o) not in naming.exclude_keys)
    return naming.item_sep.join(lines).replace("=", naming.kv_sep)


OmegaConf.register_new_resolver("rnnlab_config_groups", config_groups_help, replace=True)
OmegaConf.register_new_resolver("rnnlab_job_dirname", job_dirname, replace=True)
OmegaConf.register_new_resolver("rnnlab_sweep_dir", sweep_dir, replace=True)


def fail(message: str, code: int) -> None:
    print(f"rnnlab: error: {message}", file=sys.stderr)
    sys.exit(code)


def log_to_file(message: str, exc_info: object = None) -> None:
    """A record for train.log only (Hydra's file handler), not the console: tracebacks of
    expected failures, and of background threads, belong there."""
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    record = logging.LogRecord("rnnlab", logging.ERROR, __file__, 0, message, None, exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def quiet_background_failures() -> None:
    """Failures in threads and callbacks that are not ours (Orbax's async saves, asyncio) go to
    train.log: the main thread reports the failure once, in one line."""
    logging.raiseExceptions = False  # a full disk must not make every log call print a traceback
    absl = logging.getLogger("absl")  # Orbax: every file it writes at INFO, each failed save thrice with tracebacks
    absl.setLevel(logging.WARNING)
    absl.propagate = False
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler not in absl.handlers:
            absl.addHandler(handler)
    threading.excepthook = lambda args: log_to_file(
        f"in thread {args.thread.name if args.thread else '?'}",
        (args.exc_type, args.exc_value, args.exc_traceback))
    sys.unraisablehook = lambda args: log_to_file(
        f"unraisable: {args.err_msg or ''} {args.object!r}"[:500],
        (args.exc_type, args.exc_value, args.exc_traceback))


def exit_now(code: int | str | None) -> None:
    """Exit with `code`, and if Python's exit is still waiting for other threads STUCK_THREAD_SECONDS
    later, leave without them: after a failed save Orbax can leave threads that wait forever.
    Threads that end by themselves (joblib's workers being shut down) are waited for as usual."""
    def leave_without_them() -> None:
        time.sleep(STUCK_THREAD_SECONDS)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else EXIT_BUG)

    threading.Thread(target=leave_without_them, name="exit watchdog", daemon=True).start()
    sys.exit(code)


def sweep_job(task):
    """In a multirun, a failed job writes results.json with status "failed" and raises JobFailed.

    Hydra's launchers (basic, joblib) catch exceptions per job, so the other jobs run;
    the basic sweeper re-raises the first failure once its jobs are done, the Optuna
    sweeper marks the trial FAIL (and goes on up to `max_failure_rate`). Preemption
    still stops the whole sweep: rerunning the command resumes every job.
    A job's output (its stdout, stderr and console log lines) goes to its train.log, unless
    `log.sweep_console=true`: the terminal gets rnnlab.sweep_status's one line per finished job.
    """

    @functools.wraps(task)
    def job(cfg: DictConfig) -> float:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return task(cfg)
        if OmegaConf.select(cfg, "log.sweep_console", default=False) is True:
            return run_job(cfg, hydra_cfg)
        with job_output_to(Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"):  # train.log
            return run_job(cfg, hydra_cfg)

    def run_job(cfg: DictConfig, hydra_cfg: DictConfig) -> float:
        log = logging.getLogger("rnnlab")
        started, overrides = time.time(), list(hydra_cfg.overrides.task)
        try:
            return task(cfg)
        except SystemExit as e:  # bad input or divergence: train.py exits while handling the error
            if e.code in (0, None, EXIT_PREEMPTED) or not isinstance(e.__context__, Exception):
                raise  # preempted or interrupted: stop the sweep; rerunning it resumes every job
            error, code = str(e.__context__), e.code
            if isinstance(e.__context__, RunDirBusy):  # another process's run dir: its results.json is not ours
                log.error("job %d failed (%s): %s", hydra_cfg.job.num, " ".join(overrides), error)
                raise JobFailed(f"job {hydra_cfg.job.num} ({' '.join(overrides)}): {error}", code) from None
        except Exception as e:  # a bug, not bad input: keep the traceback in the job's train.log
            log.exception("job %d crashed", hydra_cfg.job.num)
            error, code = f"{type(e).__name__}: {e}".splitlines()[0], 1
        log.error("job %d failed (%s): %s", hydra_cfg.job.num, " ".join(overrides), error)
        write_failure(Path(hydra_cfg.runtime.output_dir) / "results.json", error, code, overrides, started)
        raise JobFailed(f"job {hydra_cfg.job.num} ({' '.join(overrides)}): {error}", code)

    return job


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@sweep_job
def main(cfg: DictConfig) -> float:
    quiet_background_failures()
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "Unable to initialize backend 'tpu'" on every start
    try:
        config = from_omegaconf(cfg)
        from rnnlab.trainer import train_and_evaluate  # JAX loads once the config is good

        hydra_config = HydraConfig.get()
        results = train_and_evaluate(config, hydra_config.runtime.output_dir, list(hydra_config.overrides.task),
                                     varied_overrides(hydra_config))
    except Exception as e:  # its code and line as every command maps them (rnnlab.exit_codes.of_error)
        code, line = exit_codes.of_error(e)
        if code == EXIT_CANNOT_WRITE:  # the storage's own error, for train.log only
            log_to_file("cannot write the run dir", e.__cause__ or e)
        elif code == EXIT_BUG:  # a bug: one line here, the traceback in train.log
            log_to_file("crashed", e)
            line += f" (the traceback is in {Path(HydraConfig.get().runtime.output_dir) / 'train.log'})"
        fail(line, code)
    if results["status"] == "preempted":
        logging.getLogger("rnnlab").warning("preempted at step %d: rerun the same command to resume", results["step"])
        hand_off_stop()  # stopped by submitit's signal (hydra/launcher=slurm): now saved, submitit requeues the job
        sys.exit(EXIT_PREEMPTED)
    return results["eval_loss"]


def hydra_error_line(e: Exception, args: list[str] = ()) -> str:
    """Hydra's multi-line composition errors as one line naming the key and the choices (for an override
    its grammar cannot parse, the command line's `args` say which)."""
    if isinstance(e, OverrideParseException):
        bad = next((a for a in args if not _parses(a)), None)
        if bad is not None:
            key = bad.split("=", 1)[0].lstrip("+~")
            return (f"key '{key}': cannot parse the override {bad!r} ({str(e).splitlines()[0]}); "
                    f"quote a value holding '=', spaces or brackets: {key}='...'")
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return f"key '{group}': got {option!r}, allowed: {', '.join(sorted(e.options))}"
    cause = str(e.__cause__ or "")
    if "is not in struct" in cause:
        key = (re.search(r"full_key: (\S+)", cause) or re.search(r"Key '([^']+)'", cause)).group(1)
        return f"unknown key '{key}' (see `python train.py --cfg job` for the keys; add a new one with +{key}=...)"
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ else [])
    lines = [line.strip() for part in parts for line in part.splitlines() if line.strip()]
    return "; ".join(line for line in lines if not line.startswith(("full_key:", "object_type=")))


def _parses(arg: str) -> bool:
    """Whether Hydra's override grammar parses `arg` (a flag like `-m` is not an override, so it does)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if arg.startswith("-"):
        return True
    try:
        OverridesParser.create().parse_overrides([arg])
    except (HydraException, ValueError):
        return False
    return True


COMPOSITION_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def composition_error_line(e: Exception, args: list[str]) -> str | None:
    """An error Hydra does not wrap, raised inside Hydra or OmegaConf while they apply the command line
    (OmegaConf's `int('y')` for `checkpoint.allow_changes.y=0`), as one line naming the override it
    most likely came from; None for an error raised elsewhere (a bug: its traceback stays)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames or not re.search(r"[/\\](hydra|omegaconf)[/\\]", frames[-1].filename):
        return None
    keys = [o.key_or_group for o in parsed_overrides(args)]
    quoted = re.findall(r"'([^']*)'", str(e))
    named = [k for k in keys if any(q in k.split(".") for q in quoted)] or keys
    where = f"key '{named[0]}'" if len(named) == 1 else f"one of the keys {', '.join(named)}"
    return (f"{where}: cannot be applied to the config ({type(e).__name__}: {e})".splitlines()[0]
            + " (a list's items are set as a whole, key=[a,b]; see `python train.py --cfg job` for the keys)")


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM in a sweep's launcher: stop as Ctrl-C does; elsewhere what it did before (end the process)."""
    if in_sweep():
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def config_exit(overrides: list[str]) -> tuple[int, str]:
    """(exit code, stderr line) that `python train.py OVERRIDES` gets from its config, in process and
    before JAX starts: (0, "") for a config that passes, (2, the line) for bad input. The fuzzer
    (tests/test_fuzz_config.py) calls it to check thousands of command lines in seconds."""
    code, line, _ = checked_config(overrides)
    return code, line


def checked_config(overrides: list[str]) -> tuple[int, str, Config | None]:
    """`config_exit`'s (exit code, stderr line) and the validated Config when it passes (None otherwise)."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "conf"), version_base="1.3"):
            config = from_omegaconf(compose(config_name="config", overrides=list(overrides)))
    except HydraException as e:
        return EXIT_BAD_INPUT, hydra_error_line(e, list(overrides)), None
    except ConfigError as e:
        return EXIT_BAD_INPUT, str(e), None
    except COMPOSITION_ERRORS as e:
        line = composition_error_line(e, list(overrides))
        if line is None:
            raise
        return EXIT_BAD_INPUT, line, None
    return 0, "", config


def run_cli() -> None:
    os.environ[SWEPT_KEYS_ENV] = ",".join(swept_keys(sys.argv[1:]))
    os.environ[SWEEP_DIR_ENV] = sweep_home(sys.argv[1:], datetime.datetime.now())
    # A SIGTERM to a sweep's launcher process (hydra/launcher=parallel: its jobs run in workers) stops it as
    # Ctrl-C does, so that it says how to resume; a job in this process replaces it with its own while it trains.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        try:
            main()
        except SweepRefused as e:  # its sweep dir is another sweep's, or cannot be written: nothing was started
            fail(e.message, e.code)
        except (KeyboardInterrupt, SystemExit) as e:
            interrupted = isinstance(e, KeyboardInterrupt) or e.code in (EXIT_PREEMPTED, EXIT_ABORTED)
            if interrupted and in_sweep():  # a sweep, stopped by a signal
                code = EXIT_ABORTED if isinstance(e, KeyboardInterrupt) else e.code
                fail(f"sweep interrupted; resume it with: {resume_command(sys.argv[1:])}", code)
            raise
    except JobFailed as e:  # a sweep job failed (the basic sweeper re-raises the first, after all its jobs ran)
        fail(f"sweep {e}; the other jobs ran (`python -m rnnlab.summarize <sweep dir>` shows each status)",
             e.exit_code)
    except HydraException as e:  # unknown key or config option, malformed override
        fail(hydra_error_line(e, sys.argv[1:]), EXIT_BAD_INPUT)
    except ConfigError as e:  # a launcher's refusal (hydra/launcher=population: a run dir another sweep holds)
        fail(str(e), EXIT_BAD_INPUT)
    except COMPOSITION_ERRORS as e:  # an override Hydra's own checks let through
        line = composition_error_line(e, sys.argv[1:])
        if line is None:
            raise
        fail(line, EXIT_BAD_INPUT)
    except OSError as e:  # Hydra could not create or write the run dir (a sweep's: its sweep dir)
        if in_sweep():
            fail(f"key 'hydra.sweep.dir': cannot write the sweep dir: {e}".splitlines()[0], EXIT_CANNOT_WRITE)
        fail(f"key 'hydra.run.dir': cannot write the run dir: {e}".splitlines()[0], EXIT_CANNOT_WRITE)
    except KeyboardInterrupt:
        fail("aborted by a second interrupt; the last completed checkpoint is intact", EXIT_ABORTED)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let Hydra's errors reach us instead of printing them
    try:
        run_cli()
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)
