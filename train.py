"""rnnlab's entry point: `python train.py [key=value ...]` or `python train.py -m ...` for sweeps.

Composes conf/ with Hydra, turns it into validated dataclasses and runs
`rnnlab.trainer.train_and_evaluate` in Hydra's run directory. Returns the final
eval loss so that optimising sweepers (Optuna) can minimise it.
"""

import functools
import logging
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rnnlab.checkpoint import CheckpointError
from rnnlab.config import ConfigError, from_omegaconf
from rnnlab.metrics import JobFailed, write_failure

EXIT_BAD_INPUT = 2  # invalid config, unusable run dir or unreadable checkpoint
EXIT_PREEMPTED = 75  # SIGTERM/SIGINT: checkpoint saved, rerun the same command to resume (EX_TEMPFAIL)

log = logging.getLogger("rnnlab")


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
        from rnnlab.trainer import train_and_evaluate  # imports JAX only once the config is known good

        results = train_and_evaluate(config, HydraConfig.get().runtime.output_dir)
    except (ConfigError, CheckpointError) as e:
        print(f"rnnlab: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if results["status"] == "preempted":
        sys.exit(EXIT_PREEMPTED)
    return results["eval_loss"]


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let a failed sweep job reach the handler below
    try:
        main()
    except JobFailed as e:  # a sweep job failed (the basic sweeper re-raises the first, after all its jobs ran)
        print(f"rnnlab: error: sweep {e}; the other jobs ran (`python scripts/summarize.py <sweep dir>` shows "
              "each status)", file=sys.stderr)
        sys.exit(e.exit_code)
