"""The quick set of scripts/benchmark.py's rows for airspeed velocity: the training loop's own
dispatch (steps per dispatch at the platform's default), compiled and warmed up in `setup`, so that
asv times warm dispatches only."""

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SCRIPTS))

import benchmark  # noqa: E402  scripts/benchmark.py
from benchmark import cpu, jax  # noqa: E402

cpu.set_cpu_xla_flags()  # as train.py and benchmark.py do, before anything starts the backend
jax.config.update("jax_num_cpu_devices", cpu.max_cpu_devices())

QUICK_ROWS = {  # name: (cell, H, B, T, L)
    "rnn-100x32x100": ("rnn", 100, 32, 100, 1),
    "lstm-100x32x100": ("lstm", 100, 32, 100, 1),
    "gru-128x1x2000": ("gru", 128, 1, 2000, 1),
    "deltanet-64x16x256": ("deltanet", 64, 16, 256, 1),
    "slstm-100x32x100": ("slstm", 100, 32, 100, 1),  # beside the LSTM's row: the same width, batch and length
    "mlstm-64x16x256": ("mlstm", 64, 16, 256, 1),
    "rwkv7-64x16x256": ("rwkv7", 64, 16, 256, 1),
}


class TrainDispatch:
    params = list(QUICK_ROWS)
    param_names = ["row"]
    timeout = 600
    warmup_time = 0.5  # after setup's compile and first dispatches: asv times warm dispatches only
    repeat = (3, 10, 4.0)  # min, max samples, seconds: the quick set stays under 3 minutes on 2 cores

    def setup(self, row):
        cell, h, b, t, layers = QUICK_ROWS[row]
        n = benchmark.default_device_count(b)
        self.runner = benchmark.LoopDispatch(benchmark.compose(cell, h, b, t, layers, [f"device.num_devices={n}"]), n)
        for _ in range(3):  # compile, then the first (slower) runs after a compile
            self.runner(self.runner.k)

    def time_steps_per_dispatch(self, row):
        """One dispatch of `steps_per_dispatch` train steps, waited for."""
        self.runner(self.runner.k)
