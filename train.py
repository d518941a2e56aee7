"""rnnlab's entry point: `python train.py [key=value ...]` or `python train.py -m ...` for sweeps.

Composes conf/ with Hydra, turns it into validated dataclasses and runs
`rnnlab.trainer.train_and_evaluate` in Hydra's run directory. Returns the final
eval loss so that optimising sweepers (Optuna) can minimise it.

Exit codes: 0 done; 2 bad input (config, run dir, unreadable checkpoints), one line on
stderr; 3 training diverged (NaN/Inf); 75 preempted by SIGTERM/SIGINT after saving a
checkpoint (rerun the same command to resume); 130 aborted by a second SIGINT.
"""

import functools
import logging
import os
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig

from rnnlab.checkpoint import CheckpointError
from rnnlab.config import ConfigError, from_omegaconf
from rnnlab.metrics import JobFailed, write_failure

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again
EXIT_ABORTED = 130


def fail(message: str, code: int) -> None:
    print(f"rnnlab: error: {message}", file=sys.stderr)
    sys.exit(code)


def sweep_job(task):
    """In a multirun, a failed job writes results.json with status "failed" and raises JobFailed.

    Hydra's launchers (basic, joblib) catch exceptions per job, so the other jobs run;
    the basic sweeper re-raises the first failure once its jobs are done, the Optuna
    sweeper marks the trial FAIL (and goes on up to `max_failure_rate`). Preemption
    still stops the whole sweep: rerunning the command resumes every job.
    """

    @functools.wraps(task)
    def job(cfg: DictConfig) -> float:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return task(cfg)
        log = logging.getLogger("rnnlab")
        started, overrides = time.time(), list(hydra_cfg.overrides.task)
        try:
            return task(cfg)
        except SystemExit as e:  # bad input or divergence: train.py exits while handling the error
            if e.code in (0, None, EXIT_PREEMPTED) or not isinstance(e.__context__, Exception):
                raise  # preempted or interrupted: stop the sweep; rerunning it resumes every job
            error, code = str(e.__context__), e.code
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
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file it writes at INFO
    try:
        config = from_omegaconf(cfg)
        from rnnlab.trainer import NonFiniteLossError, train_and_evaluate  # JAX loads once the config is good

        try:
            results = train_and_evaluate(config, HydraConfig.get().runtime.output_dir)
        except NonFiniteLossError as e:
            fail(str(e), EXIT_DIVERGED)
    except (ConfigError, CheckpointError) as e:
        fail(str(e), EXIT_BAD_INPUT)
    if results["status"] == "preempted":
        logging.getLogger("rnnlab").warning("preempted at step %d: rerun the same command to resume", results["step"])
        sys.exit(EXIT_PREEMPTED)
    return results["eval_loss"]


def hydra_error_line(e: Exception) -> str:
    """Hydra's multi-line composition errors as one line naming the key and the choices."""
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


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let Hydra's errors reach us instead of printing them
    try:
        main()
    except JobFailed as e:  # a sweep job failed (the basic sweeper re-raises the first, after all its jobs ran)
        fail(f"sweep {e}; the other jobs ran (`python scripts/summarize.py <sweep dir>` shows each status)",
             e.exit_code)
    except HydraException as e:  # unknown key or config option, malformed override
        fail(hydra_error_line(e), EXIT_BAD_INPUT)
    except OSError as e:  # Hydra could not create or write the run dir
        fail(f"cannot write the run dir: {e}", EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        fail("aborted by a second interrupt; the last completed checkpoint is intact", EXIT_ABORTED)
