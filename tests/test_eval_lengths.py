"""`data.eval_seq_lens`: every evaluation also runs at each listed length, with its own eval step
compiled once, under pmap and shard_map and on several devices; TensorBoard tags
`eval/<metric>@<len>`, results.json's `eval_by_len`, one console line per length."""

import json
import logging

import jax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import compose_config, fast_first, tiny_config
from rnnlab import config as cfg
from rnnlab.metrics import hparam_metric_tags
from rnnlab.trainer import train_and_evaluate

# Train at 6 bits; evaluate at 6 (the usual eval) and at 3, 6 and 11.
PARITY = ["data=parity", "data.seq_len=6", "data.eval_seq_lens=[3,6,11]", "steps=4", "log_every=2", "eval_every=2",
          "checkpoint.enabled=false"]


def strict_json(path):
    def refuse(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    return workdir, train_and_evaluate(tiny_config(*PARITY, "data.min_seq_len=2"), workdir)


def test_results_json_has_eval_by_len_beside_the_usual_eval_keys(parity_run):
    workdir, results = parity_run
    on_disk = strict_json(workdir / "results.json")
    assert set(on_disk["eval_by_len"]) == {"3", "6", "11"}
    for at_length in on_disk["eval_by_len"].values():
        assert set(at_length) == {"loss", "accuracy"} and all(isinstance(v, float) for v in at_length.values())
    # The usual keys are unchanged; data.seq_len's entry is the usual eval.
    assert on_disk["eval_metrics"] == {"accuracy": on_disk["eval_metric"]} and on_disk["eval_metric_name"] == "accuracy"
    assert on_disk["eval_by_len"]["6"] == {"loss": on_disk["eval_loss"], "accuracy": on_disk["eval_metric"]}
    assert on_disk["eval_by_len"]["11"]["loss"] != on_disk["eval_loss"]
    assert on_disk["eval_by_len"] == results["eval_by_len"]


def test_tensorboard_has_a_loss_and_every_metric_at_every_length(parity_run):
    workdir, results = parity_run
    events = EventAccumulator(str(workdir / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"eval/{name}@{n}" for name in ("loss", "accuracy") for n in (3, 6, 11)} <= tags
    assert {"eval/loss", "eval/accuracy", "train/loss", "train/accuracy"} <= tags
    for n in ("3", "6", "11"):
        assert [e.step for e in events.Scalars(f"eval/loss@{n}")] == [2, 4]
        assert events.Scalars(f"eval/accuracy@{n}")[-1].value == pytest.approx(results["eval_by_len"][n]["accuracy"])
    assert [e.value for e in events.Scalars("eval/loss@6")] == [e.value for e in events.Scalars("eval/loss")]


def test_without_eval_lengths_eval_by_len_is_empty(tmp_path):
    results = train_and_evaluate(tiny_config("steps=2", "eval_every=2", "checkpoint.enabled=false"), tmp_path)
    assert results["eval_by_len"] == {} and strict_json(tmp_path / "results.json")["eval_by_len"] == {}


@pytest.mark.parametrize("strategy,devices", fast_first([("pmap", 2), ("shard_map", 4)], why="cross-product",
                                                      first_why="long"))
def test_each_length_compiles_once_and_matches_one_device(tmp_path, caplog, strategy, devices):
    """Several devices, several evaluations: one eval step and one batch sampler more per further
    length, each compiled once; the numbers are those of one device."""
    config = tiny_config(*PARITY, "steps=8", "data.min_seq_len=2", f"device.num_devices={devices}",
                         f"device.strategy={strategy}")
    with caplog.at_level(logging.INFO):
        jax.config.update("jax_log_compiles", True)
        try:
            many = train_and_evaluate(config, tmp_path / "many")
        finally:
            jax.config.update("jax_log_compiles", False)
    names = ("jit(_fun)", "jit(steps)", "jit(one_step)", "jit(sample)", "jit(train_step)", "jit(eval_step)", "jit(<lambda>)",
             "jit(one)")  # one: a program over a member axis of one (`steps.over_members`)
    compiles = [r.getMessage()[:60] for r in caplog.records if r.getMessage().startswith(tuple(f"Compiling {n}" for n in names))]
    # Train dispatch, eval sampler and eval step (as tests/test_trainer.py counts them), then a sampler
    # and an eval step for 3 and for 11 (6 is data.seq_len: the usual eval's).
    assert len(compiles) == 3 + 2 * 2, compiles
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval step 8 at length")]
    assert [line.split(" |")[0] for line in lines] == [f"eval step 8 at length {n}" for n in (3, 6, 11)]
    one = train_and_evaluate(tiny_config(*PARITY, "steps=8", "data.min_seq_len=2"), tmp_path / "one")
    assert many["train_loss"] == pytest.approx(one["train_loss"], rel=1e-4)  # variable lengths: the same batches
    assert many["num_devices"] == devices and set(many["eval_by_len"]) == {"3", "6", "11"}
    for n, at_length in one["eval_by_len"].items():
        for name, value in at_length.items():
            assert many["eval_by_len"][n][name] == pytest.approx(value, rel=1e-4), (n, name)


def test_hparams_list_every_metric_at_every_length():
    assert hparam_metric_tags(("accuracy",), (3, 11)) == (
        "eval/loss", "eval/accuracy", "eval/accuracy@3", "eval/accuracy@11", "train/loss", "perf/tokens_per_sec")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data=mqar", "data.eval_seq_lens=[64,8]"], "key 'data.eval_seq_lens': got [64, 8], allowed: a list of "
                                                      "distinct lengths, each >= 16 (the mqar task's minimum)"),
        (["data=copy", "data.eval_seq_lens=[40,40]"], "key 'data.eval_seq_lens': got [40, 40], allowed: a list of distinct"),
        (["data=adding", "data.eval_seq_lens=[1]"], "each >= 2 (the adding task's minimum)"),
        (["data=parity", "data.eval_seq_lens=[a]"], "key 'data.eval_seq_lens': got 'a', expected an integer"),
        (["data=parity", "data.eval_seq_lens=12"], "key 'data.eval_seq_lens': got 12, expected a list"),
    ],
)
def test_bad_eval_lengths_name_the_key_and_what_is_allowed(overrides, message):
    with pytest.raises(cfg.ConfigError) as info:
        compose_config(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow("end-to-end")  # the line itself is checked in process above; this is train.py's exit code around it
def test_train_py_exits_2_with_one_line_for_a_bad_data_key(tmp_path):
    from conftest import TINY, run_train

    proc = run_train([*TINY, "data=adding", "data.min_seq_len=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("rnnlab: error: key 'data.min_seq_len': got 3, but every "
                                                           "adding example has data.seq_len steps")


@pytest.mark.parametrize("strategy", fast_first(["pmap", "shard_map"], why="cross-product", first_why="long"))
def test_eval_examples_are_the_models_outputs_on_their_inputs(strategy):
    """The examples the eval step returns beside its metrics are the model's outputs on the first device's first
    examples, as a separate `model.apply` gives them."""
    import numpy as np

    from rnnlab import steps, tasks
    from rnnlab.models import build_model

    config = tiny_config("data=copy", "data.seq_len=12", "batch_size=8", f"device.strategy={strategy}")
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    devices = jax.devices()[:2]
    fns = steps.make_step_functions(config, task, devices, 1, examples=3)
    state = steps.create_train_state(jax.random.key(1), model, task.example_inputs(1), tx)
    _, examples = fns.evaluate(fns.dp.replicate(state))
    inputs, targets, outputs = examples
    assert inputs.shape[0] == targets.shape[0] == outputs.shape[0] == 3
    np.testing.assert_allclose(outputs, model.apply({"params": state.params}, inputs), rtol=1e-5, atol=1e-6)
