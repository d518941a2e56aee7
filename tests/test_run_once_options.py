"""The programs a run calls once compile with `steps.run_once_options` (LLVM at O1 on CPU) to the values the
default options give: the initialisation of every cell and the eval batches of every task, bit for bit. In a
subprocess with XLA's optimisation passes on, as users compile (this suite turns most of them off)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import CONF_DIR, ROOT, fast_first

CHECK = """
import json, sys
import jax, numpy as np
from hydra import compose, initialize_config_dir
from rnnlab import config as cfg, parallel, steps, tasks
from rnnlab.models import build_model

def equal(a, b):
    return jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a, b))

overrides, report, batches_equal = json.loads(sys.argv[1]), {}, {}
for extra in overrides:
    with initialize_config_dir(config_dir=sys.argv[2], version_base="1.3"):
        config = cfg.from_omegaconf(compose("config", overrides=["hidden_dim=16", "num_layers=2", *extra]))
    devices = parallel.start_backend(config)
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    key, example = jax.random.key(3), task.example_inputs(2)
    inits = [jax.jit(model.init, compiler_options=o)(key, example) for o in (None, steps.run_once_options("cpu"))]
    if task.name not in batches_equal:  # a task's eval batches are one program whichever cell reads them
        dp = parallel.DataParallel(devices[:2], "pmap")
        sample = steps.make_sampler(task, tasks.stream_key(0, tasks.EVAL_STREAM), 2, dp)
        lowered = sample.lower(dp.host_scalar(0))
        batches = [lowered.compile(compiler_options=o)(dp.host_scalar(5)) for o in (None, steps.run_once_options("cpu"))]
        batches_equal[task.name] = equal(*batches)
    report[" ".join(extra)] = [equal(*inits), batches_equal[task.name]]
print(json.dumps(report))
"""

TASKS = ["data=mqar", "data=word_problem", "data=adding", "data=selective_copy", "data=modular_arithmetic",
         "data=copy", "data=parity"]
# Every cell conf/ names (the registry may also hold cells that other tests register), rwkv7 first: the fast case.
CELLS = sorted((p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")), key=lambda c: (c != "rwkv7", c))
CASES = [[f"model={cell}", task] for cell, task in zip(CELLS, TASKS * 3)]


@pytest.mark.parametrize("cases", fast_first([CASES[:1], CASES[1:]], why="cross-product", first_why="long"))
def test_run_once_options_give_the_default_values(cases):
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cases), CONF_DIR], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {" ".join(case): [True, True] for case in cases}
