"""Where a second simulated CPU device starts to pay: for each shape, the train step's matmul FLOPs per
time step and its time on 1 device and on one per core, timed as `device.num_devices=null` times them.

    python scripts/device_count_probe.py "model=rnn hidden_dim=16" "model=rnn hidden_dim=64" ...

Each argument is one shape, as train.py overrides (added to `device=cpu`). It sets
`rnnlab.cpu.device_count_by_rule`'s bounds (docs/performance-notes.md records the runs behind it).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rnnlab import cpu  # noqa: E402

cpu.set_cpu_xla_flags()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", cpu.max_cpu_devices())  # before the backend starts
from hydra import compose, initialize_config_dir  # noqa: E402

from rnnlab import flops, parallel, tasks  # noqa: E402
from rnnlab.config import from_omegaconf  # noqa: E402
from rnnlab.loop import MAX_STEPS_IN_FLIGHT  # noqa: E402
from rnnlab.models import build_model  # noqa: E402
from rnnlab.steps import PARAMS_STREAM, create_train_state, default_steps_per_dispatch, make_dispatch, make_optimizer  # noqa: E402


def probe(overrides: list[str]) -> tuple[float, dict[int, float]]:
    """(matmul FLOPs per time step, {devices: seconds per step})."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = from_omegaconf(compose(config_name="config", overrides=["device=cpu", *overrides]))
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = make_optimizer(config.optimizer, config.steps)
    key = jax.random.fold_in(jax.random.key(config.seed), PARAMS_STREAM)
    k = config.device.steps_per_dispatch or default_steps_per_dispatch("cpu")
    step = flops.train_step_flops(config.model, task.input_dim, task.output_dim, config.batch_size * task.total_len,
                                  task.total_len, task.token_inputs)
    timings = {}
    for n in sorted({1, cpu.cpu_device_count(config.batch_size, len(jax.devices()))}):
        dp = parallel.DataParallel(jax.devices()[:n], config.device.strategy)
        per_device = config.batch_size // n
        state = dp.replicate(create_train_state(key, model, task.example_inputs(per_device), tx))
        dispatch = make_dispatch(config, task, dp, per_device, k)
        timings[n] = cpu.seconds_per_step(dispatch, state, k, MAX_STEPS_IN_FLIGHT)
    return step / task.total_len, timings


if __name__ == "__main__":
    for shape in sys.argv[1:]:
        per_time_step, timings = probe(shape.split())
        ratio = timings[1] / timings[max(timings)]
        print(f"{shape:60s} {per_time_step / 1e6:9.3f} MFLOP/time step  "
              + "  ".join(f"{n} dev {1e3 * t:8.2f} ms" for n, t in timings.items()) + f"  1/{max(timings)}: {ratio:.2f}x",
              flush=True)
