"""rnnlab's entry point: `python train.py [key=value ...]` or `python train.py -m ...` for sweeps.

Composes conf/ with Hydra, turns it into validated dataclasses and runs
`rnnlab.trainer.train_and_evaluate` in Hydra's run directory. Returns the final
eval loss so that optimising sweepers (Optuna) can minimise it.
"""

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rnnlab.checkpoint import CheckpointError
from rnnlab.config import ConfigError, from_omegaconf

EXIT_BAD_INPUT = 2  # invalid config, unusable run dir or unreadable checkpoint
EXIT_PREEMPTED = 75  # SIGTERM/SIGINT: checkpoint saved, rerun the same command to resume (EX_TEMPFAIL)

log = logging.getLogger("rnnlab")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
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
    main()
