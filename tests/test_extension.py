"""A cell and a task defined outside the package, here, registered, and trained through
`train_and_evaluate` and through `train.py` with `model=...`/`data=...`.

This module is also what the train.py subprocess imports (`imports=[test_extension]`),
so it imports nothing from conftest at module level.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rnnlab import cells, flops, tasks

TESTS = Path(__file__).resolve().parent


@cells.register_cell
class DiagonalCell(cells.Cell):
    """`h_t = tanh(u_t + w * h_{t-1})`: a per-unit recurrent weight w: f32[H], no matmul in the step."""

    name = "diagonal"

    def param_specs(self):
        return {"w": ((self.hidden_dim,), lambda key, shape, dtype=jnp.float32: jnp.full(shape, 0.5, dtype))}

    def step(self, params, h, u):
        h = jnp.tanh(u + params["w"] * h)
        return h, h, None

    def recurrent_flops(self):
        return 0


@tasks.register_task
class FirstBitTask(tasks.Task):
    """Random bits (one-hot); at the last step, say which bit came first. Two metrics."""

    name = "first_bit"
    input_dim = 2
    output_dim = 2
    min_seq_len = 2

    @property
    def baseline_loss(self):
        return math.log(2)

    def sample_one(self, key):
        bits = jax.random.bernoulli(key, 0.5, (self.seq_len,)).astype(jnp.int32)
        return jax.nn.one_hot(bits, 2), bits[0]

    def loss_and_metrics(self, outputs, targets):
        logits = outputs[:, -1]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        probability = jax.nn.softmax(logits)[jnp.arange(targets.shape[0]), targets]
        return loss, {"accuracy": (logits.argmax(-1) == targets).mean(), "confidence": probability.mean()}


def test_registered_names_are_config_choices():
    from conftest import tiny_config

    from rnnlab.config import ConfigError

    assert "diagonal" in cells.cell_names() and "first_bit" in tasks.task_names()
    config = tiny_config("model.cell=diagonal", "model.recurrence=autodiff", "data.task=first_bit")
    assert config.model.cell == "diagonal" and config.data.task == "first_bit"
    with pytest.raises(ConfigError, match="key 'model.recurrence'.*no hand-written backward; allowed: autodiff"):
        tiny_config("model.cell=diagonal", "model.recurrence=custom_vjp")
    with pytest.raises(ConfigError, match="key 'data.seq_len'.*first_bit task needs >= 2"):
        tiny_config("data.task=first_bit", "data.seq_len=1")


def test_the_new_cell_computes_its_equations():
    from rnnlab.models import RecurrentLayer

    x = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float32)  # time-major [T, B, I]
    layer = RecurrentLayer(hidden_dim=6, cell="diagonal")
    params = jax.jit(layer.init)(jax.random.key(0), x)["params"]
    got = np.asarray(jax.jit(layer.apply)({"params": params}, x)[0])
    w_xh, b, w = (np.asarray(a, np.float64) for a in (params["W_xh"], params["b"], params["cell"]["w"]))
    h, want = np.zeros((3, 6)), []
    for x_t in x.astype(np.float64):
        h = np.tanh(x_t @ w_xh + b + w * h)
        want.append(h)
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow("long")
def test_the_new_cell_and_task_train_through_train_and_evaluate(tmp_path):
    from conftest import tiny_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rnnlab.trainer import train_and_evaluate

    config = tiny_config("model.cell=diagonal", "model.recurrence=autodiff", "data.task=first_bit", "data.seq_len=3",
                         "steps=80", "log_every=20", "eval_every=80", "optimizer.lr=0.03", "optimizer.warmup_steps=0")
    results = train_and_evaluate(config, tmp_path)
    assert results["status"] == "completed" and results["task"] == "first_bit"
    assert set(results["eval_metrics"]) == {"accuracy", "confidence"}
    assert results["eval_metric_name"] == "accuracy" and results["eval_metric"] == results["eval_metrics"]["accuracy"]
    assert results["eval_metrics"]["accuracy"] > 0.9  # it learns: recall over 3 steps needs little memory
    assert results["eval_loss"] < 0.5 * results["baseline_loss"]
    assert results["flops_per_step"] == flops.train_step_flops(config.model, 2, 2, results["tokens_per_step"], 3)
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert {"eval/accuracy", "eval/confidence", "train/accuracy", "train/confidence"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("options", [[], ["model.remat=true"], ["num_layers=3", "model.scan_layers=false"]])
def test_the_flop_count_of_the_new_cell_equals_its_traced_matmuls(options):
    """The cell declares `recurrent_flops` (0: no matmul in its step); the analytic count must match the traced step."""
    from test_flops import analytic, step_and_args

    step, args, config, task = step_and_args(["batch_size=4", "hidden_dim=8", "num_layers=2", "data.seq_len=5",
                                             "model.cell=diagonal", "model.recurrence=autodiff", *options])
    assert flops.jaxpr_matmul_flops(step, *args) == analytic(config, task).executed


@pytest.mark.slow("end-to-end")
def test_the_new_cell_and_task_train_through_train_py(tmp_path):
    from conftest import ROOT, train_env

    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir()
    (conf / "model" / "diagonal.yaml").write_text(textwrap.dedent("""\
        defaults:
          - rnn             # every key of model/rnn.yaml, then these
          - _self_
        cell: diagonal
        recurrence: autodiff
    """))
    (conf / "data" / "first_bit.yaml").write_text("task: first_bit\nseq_len: 8\n")
    env = train_env({"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"hydra.searchpath=[file://{conf}]", "imports=[test_extension]",
         "model=diagonal", "data=first_bit", "steps=4", "batch_size=8", "hidden_dim=8", "log_every=2",
         "eval_every=4", "eval_batches=1", "device.num_devices=1", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "completed" and set(results["eval_metrics"]) == {"accuracy", "confidence"}
    saved = json.loads((tmp_path / "run" / "checkpoints" / "run_config.json").read_text())
    assert saved["model.cell"] == "diagonal" and saved["data.task"] == "first_bit"
