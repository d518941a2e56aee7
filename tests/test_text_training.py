"""data=text's training and evaluation (truncated BPTT, rnnlab.steps), against references written here with the
model alone: the carried state is the state of the text read so far, reset where a document or an epoch starts
(every step with data.carry_state=false), its gradient stopped; 1 and 2 devices (pmap, shard_map) carry the same
state; the held-out text's bpc (carried) and bpc_reset (reset every segment) are those of a host loop over
its windows. The fixture corpus only (tests/data/text_fixture), tiny models."""

import dataclasses
import json
import math
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, TEXT_FIXTURE_DATA, assert_same_tree, run_train, saved_state, tiny_config, train_env

from rnnlab import parallel, tasks
from rnnlab import sample as sample_cli
from rnnlab.models import build_model, initial_state
from rnnlab.steps import (CarryTrainState, create_train_state, make_dispatch, make_optimizer, make_stream_evaluator,
                          state_batch_axes, train_metric_names)
from rnnlab.trained import load_run

BATCH, SEQ_LEN = 4, 16  # stream 3 reaches a document start at step 4


# Windowed attention carries its ring buffer of the last `window` steps' keys and values as the recurrences carry theirs.
CARRIED_MODELS = [("model=lstm",), ("model=attention", "model.window=6", "model.block_size=4")]


def text_config(*overrides, lr=None, model=CARRIED_MODELS[0]):
    config = tiny_config(*TEXT_FIXTURE_DATA, *model, "num_layers=2", "hidden_dim=8", f"batch_size={BATCH}",
                         f"data.seq_len={SEQ_LEN}", "data.eval_streams=3", *overrides)
    if lr is not None:  # lr=0: the parameters never move, so each step can be compared with one forward
        config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, lr=lr))
    return config


def setup(config):
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = make_optimizer(config.optimizer, config.steps)
    state = create_train_state(jax.random.key(0), model, task.example_inputs(BATCH), tx, carry_batch=BATCH)
    return task, model, state


def train(config, steps, devices=1, strategy="pmap"):
    """(the host state after `steps` steps, the metric rows of each) on `devices` devices, a step a dispatch."""
    task, model, state = setup(config)
    dp = parallel.DataParallel(jax.devices()[:devices], strategy)
    dispatch = make_dispatch(config, task, dp, BATCH // devices, 1)
    state, rows = dp.replicate(state), []
    names = train_metric_names(task, False)
    for _ in range(steps):
        state, row = dispatch(state, 1)
        rows.append(dict(zip(names, map(float, dp.to_host(row)))))
    return dp.to_host(state), rows


def replay(config, steps, carry_state=True):
    """By hand: the model run step by step over `sample_step`'s windows from the carried state, each row reset to
    the initial state where its window says (every step without carry_state) -> (final state, losses, resets
    by document start alone)."""
    task, model, state = setup(config)
    arrays = task.arrays()
    fresh = initial_state(model, BATCH)
    axes = state_batch_axes(model)
    carry, losses, document_resets = fresh, [], 0
    draw = jax.jit(lambda k: task.sample_step(arrays, k, 0, BATCH, BATCH))
    apply = jax.jit(lambda params, inputs, carry: model.apply({"params": params}, inputs, state=carry))
    for k in range(steps):
        w = draw(jnp.int32(k))
        reset = np.asarray(w.reset[:, 0]) if carry_state else np.ones(BATCH, bool)
        document_resets += int(reset.sum()) if k % task.train_layout(BATCH).steps_per_epoch else 0
        carry = jax.tree_util.tree_map(
            lambda c, f, a: jnp.where(jnp.asarray(reset).reshape([-1 if i == a else 1 for i in range(c.ndim)]), f, c),
            carry, fresh, axes)
        outputs, carry = apply(state.params, w.inputs, carry)
        losses.append(float(task.loss_and_metrics(outputs, w.targets)[0]))
    return carry, losses, document_resets


def assert_tree_close(a, b, rtol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("model", [CARRIED_MODELS[0],
                                   pytest.param(CARRIED_MODELS[1], marks=pytest.mark.slow("cross-product"))],
                         ids=lambda m: m[0])
def test_the_train_state_carries_the_state_of_the_text_read_so_far_reset_at_each_document(model):
    config = text_config(lr=0.0, model=model)
    steps = 6
    state, rows = train(config, steps)
    assert isinstance(state, CarryTrainState)
    carry, losses, document_resets = replay(config, steps)
    assert document_resets >= 1  # a document started inside a stream: that row's state was reset there
    assert_tree_close(state.carry, carry)
    np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=1e-5)
    np.testing.assert_allclose([r["bpc"] for r in rows], np.array(losses) / math.log(2), rtol=1e-5)


@pytest.mark.slow("long")
def test_with_carry_state_false_every_step_starts_from_the_initial_state():
    config = text_config("data.carry_state=false", lr=0.0)
    state, rows = train(config, 3)
    carry, losses, _ = replay(config, 3, carry_state=False)
    assert_tree_close(state.carry, carry)
    np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=1e-5)
    carried, carried_losses, _ = replay(text_config(lr=0.0), 3)
    assert abs(carried_losses[-1] - losses[-1]) > 1e-6  # the carried state does change the loss


@pytest.mark.parametrize("model", [pytest.param(CARRIED_MODELS[0], marks=pytest.mark.slow("long")),
                                   pytest.param(CARRIED_MODELS[1], marks=pytest.mark.slow("cross-product"))],
                         ids=lambda m: m[0])
def test_two_steps_with_the_carry_are_one_forward_over_both_windows_with_the_gradient_stopped_between(model):
    config = text_config(lr=0.0, model=model)
    task, model, state = setup(config)
    arrays = task.arrays()
    w0, w1 = (task.sample_step(arrays, jnp.int32(k), 0, BATCH, BATCH) for k in (0, 1))
    assert not np.asarray(w1.reset).any()  # one document runs on across both steps in every stream
    params, fresh = state.params, initial_state(model, BATCH)
    apply = jax.jit(model.apply)  # a program a shape, not one a primitive
    both, after_both = apply({"params": params}, jnp.concatenate([w0.inputs, w1.inputs], 1), state=fresh)
    _, after_first = apply({"params": params}, w0.inputs, state=fresh)
    trained, rows = train(config, 2)
    assert_tree_close(trained.carry, after_both, rtol=1e-5)
    np.testing.assert_allclose(rows[1]["loss"], task.loss_and_metrics(both[:, SEQ_LEN:], w1.targets)[0], rtol=1e-5)

    def second_loss(p, start):
        return task.loss_and_metrics(apply({"params": p}, w1.inputs, state=start)[0], w1.targets)[0]

    stopped = optax.tree.norm(jax.jit(jax.grad(second_loss))(params, after_first))
    through = optax.tree.norm(jax.jit(jax.grad(
        lambda p: second_loss(p, apply({"params": p}, w0.inputs, state=fresh)[1])))(params))
    np.testing.assert_allclose(rows[1]["grad_norm"], stopped, rtol=1e-5)
    assert abs(float(through) - float(stopped)) > 1e-4 * float(stopped)  # the gradient did not flow into step 1


@pytest.mark.parametrize("strategy", [pytest.param("pmap", marks=pytest.mark.slow("long")),
                                      pytest.param("shard_map", marks=pytest.mark.slow("cross-product"))])
def test_two_devices_carry_the_state_and_train_as_one(strategy):
    one, rows_one = train(text_config(lr=0.0), 6)
    two, rows_two = train(text_config(lr=0.0), 6, devices=2, strategy=strategy)
    assert_tree_close(two.carry, one.carry)  # every stream's state, gathered in row order
    trained_one, _ = train(text_config(), 3)
    trained_two, _ = train(text_config(), 3, devices=2, strategy=strategy)
    assert len(jax.tree_util.tree_leaves(trained_one)) == len(jax.tree_util.tree_leaves(trained_two))
    assert_tree_close(trained_two.carry, trained_one.carry, rtol=1e-3)


def reference_eval(task, model, params, split="valid"):
    """(bpc carried, bpc reset every segment) of `split` by a host loop over its eval windows, summed in float64."""
    arrays, layout = task.arrays(split), task.eval_layout(split)
    rows = task.eval_streams
    fresh = initial_state(model, rows)
    axes = state_batch_axes(model)
    carry, sums = fresh, {"carried": [0.0, 0], "reset": [0.0, 0]}
    apply = jax.jit(model.apply)  # one program for every window, not one a primitive
    for k in range(layout.num_segments):
        w = task.eval_window(arrays, jnp.int32(k), 0, rows, True)
        reset = np.asarray(w.reset[:, 0])
        carry = jax.tree_util.tree_map(
            lambda c, f, a: jnp.where(jnp.asarray(reset).reshape([-1 if i == a else 1 for i in range(c.ndim)]), f, c),
            carry, fresh, axes)
        out_carried, carry = apply({"params": params}, w.inputs, state=carry)
        out_reset, _ = apply({"params": params}, w.inputs, state=fresh)
        targets = np.asarray(w.targets)
        scored = targets != tasks.IGNORE
        for name, out in (("carried", out_carried), ("reset", out_reset)):
            log_p = np.asarray(jax.nn.log_softmax(out.astype(jnp.float32), -1), np.float64)
            picked = np.take_along_axis(log_p, np.where(scored, targets, 0)[..., None], -1)[..., 0]
            sums[name][0] -= picked[scored].sum()
            sums[name][1] += int(scored.sum())
    assert sums["carried"][1] == sum(len(task.splits[split].document(n)) - 1 for n in task.splits[split].names)
    return tuple(total / count / math.log(2) for total, count in sums.values())


@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow("long")),
                                     pytest.param(2, marks=pytest.mark.slow("cross-product"))])
def test_bpc_carried_and_reset_are_those_of_a_host_loop_over_the_held_out_text(devices):
    config = text_config()
    state, _ = train(config, 4)  # trained a little, so the carried state matters
    task, model, _ = setup(config)
    want = reference_eval(task, model, state.params)
    dp = parallel.DataParallel(jax.devices()[:devices], "pmap")
    evaluator = make_stream_evaluator(config, task, dp, "valid")
    (metrics,) = dp.to_host(evaluator.segments.run(dp.replicate(state), evaluator.batches))
    np.testing.assert_allclose([metrics["bpc"], metrics["bpc_reset"]], want, rtol=1e-5)
    assert metrics["bpc"] != metrics["bpc_reset"]


def test_the_held_out_evaluation_stops_between_its_chunks_when_asked():
    from rnnlab.steps import EvalInterrupted

    config = text_config()
    task, _, state = setup(config)
    dp = parallel.DataParallel(jax.devices()[:1], "pmap")
    evaluator = make_stream_evaluator(config, task, dp, "valid")
    assert evaluator.segments.whole > 2
    asked = []

    def should_stop():  # asked before each chunk: the first runs, then a stop is requested
        asked.append(True)
        return len(asked) > 1

    with pytest.raises(EvalInterrupted):
        evaluator.segments.run(dp.replicate(state), evaluator.batches, should_stop)
    assert len(asked) == 2


@pytest.mark.parametrize("override, key", [("data.eval_seq_lens=[16]", "key 'data.eval_seq_lens'"),
                                           ("model=attention", "key 'model.window'")])
def test_what_the_streams_cannot_do_is_refused_in_one_line(override, key, tmp_path):
    result = run_train([*TEXT_FIXTURE_DATA, override, "steps=2", "batch_size=2", f"hydra.run.dir={tmp_path}"],
                       cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"rnnlab: error: {key}")


def planned(config, workdir):
    """`rnnlab.setup.plan` of `config` on one device: every refusal before anything is allocated or compiled."""
    from rnnlab.checkpoint import Checkpointer
    from rnnlab.setup import plan

    checkpointer = Checkpointer(workdir / "checkpoints", 0, 1)
    try:
        return plan(config, workdir, jax.devices()[:1], checkpointer)
    finally:
        checkpointer.close()


def test_eval_streams_that_cannot_fit_are_refused_before_training_naming_data_eval_streams(tmp_path, monkeypatch):
    """The memory pre-check counts the held-out text's evaluation: every stream's rows of state and its forwards
    (logits of 256 bytes a position) beside the train state; too many streams are refused naming
    data.eval_streams and about how many fit, not the keys that size training."""
    from rnnlab import memory

    monkeypatch.setattr(memory, "free_bytes", lambda devices: 2.0**30)
    planned(text_config(), tmp_path / "few")  # data.eval_streams=3 fits
    with pytest.raises(memory.OutOfMemoryError) as info:  # 100,000 streams: about 3.6 GiB of logits alone
        planned(text_config("data.eval_streams=100000"), tmp_path / "many")
    message = str(info.value)
    assert message.startswith("key 'data.eval_streams': evaluating the held-out text through 100,000 streams")
    assert "allowed: fewer data.eval_streams (at most about " in message and "hidden_dim" not in message
    assert "\n" not in message


def test_an_out_of_memory_evaluation_is_named_by_the_keys_that_size_it():
    try:
        jax.numpy.zeros((2**46,), jax.numpy.int8).block_until_ready()
    except Exception as e:  # noqa: BLE001
        error = e
    from rnnlab import memory

    text = str(memory.out_of_memory_error(error, text_config("data.eval_streams=7"), evaluating=True))
    assert text.startswith("out of memory in an evaluation (") and "data.eval_streams=7" in text
    assert "hidden_dim" not in text and "\n" not in text


def test_offline_an_unprepared_corpus_exits_2_in_one_line(tmp_path):
    result = run_train(["data=text", "steps=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                       env_extra={"XDG_CACHE_HOME": str(tmp_path / "empty"), "RNNLAB_OFFLINE": "1"})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rnnlab: error: data.corpus 'shakespeare' is not prepared") and "prepare shakespeare" in line


def test_sampling_at_temperature_0_or_top_1_is_greedy_and_a_seed_repeats():
    from rnnlab import decode

    task, model, state = setup(text_config())
    prompt = jnp.asarray(np.frombuffer(b"The ferry", np.uint8).astype(np.int32)[None].repeat(2, 0))
    logits, carry = decode.prefill(model, state.params, prompt, initial_state(model, 2))
    first = logits[:, -1].argmax(-1)
    greedy, _ = decode.decode(model, state.params, carry, first, 12)
    key = jax.random.key(3)
    for temperature, top_k in ((0.0, 0), (1.0, 1)):
        drawn, _ = decode.sample(model, state.params, carry, first, 12, key, temperature, top_k)
        np.testing.assert_array_equal(drawn, greedy)
    a, _ = decode.sample(model, state.params, carry, first, 12, key, 1.0, 5)
    b, _ = decode.sample(model, state.params, carry, first, 12, key, 1.0, 5)
    np.testing.assert_array_equal(a, b)
    assert ((0 <= np.asarray(a)) & (np.asarray(a) < 256)).all()


TEXT_RUN = ("num_layers=1", "data.seq_len=8", "data.eval_streams=2", "steps=2", "eval_every=2", "checkpoint.every=2")


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny data=text run with its checkpoint and the .hydra/config.yaml train.py writes, trained in process once
    for this module; a test that writes into it takes a copy (`copied`)."""
    from omegaconf import OmegaConf

    from rnnlab import config as cfg
    from rnnlab.trainer import train_and_evaluate

    run = tmp_path_factory.mktemp("text") / "run"
    config = text_config(*TEXT_RUN)
    first = train_and_evaluate(config, run)
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(json.loads(json.dumps(cfg.to_dict(config)))), run / ".hydra" / "config.yaml")
    return run, first


def copied(run, to):
    shutil.copytree(run, to)
    return to


def test_a_finished_text_run_evaluates_again_with_other_eval_streams(text_run, tmp_path):
    """data.eval_streams only cuts the held-out text for evaluation (`Task.eval_options`): a finished data=text run
    rerun with another value evaluates again, as for any eval key, instead of refusing it as a training change."""
    from rnnlab.trainer import train_and_evaluate

    run, first = text_run
    run = copied(run, tmp_path / "run")
    again = train_and_evaluate(text_config(*TEXT_RUN, "data.eval_streams=3"), run)
    for key in ("train_loss", "tokens_per_sec", "compile_seconds"):
        assert again[key] == first[key], key
    assert first["config"]["data.eval_streams"] == 2
    assert again["config"]["data.eval_streams"] == 3 and again["status"] == "completed"
    assert again["eval_metrics"]["bpc_reset"] is not None and again["test_bpc"] is not None
    assert again["test_bpc"] != first["test_bpc"]  # evaluated again: three streams cut the test text otherwise
    assert not (run / "checkpoints" / "config_history.json").exists()  # no training change was recorded


@pytest.mark.parametrize("args, message", [
    (["--length", "2147483648"], "argument --length: got '2147483648', allowed: a whole number from 1 to 1,000,000"),
    (["--length", "100000000"], "argument --length: got '100000000', allowed: a whole number from 1 to 1,000,000"),
    (["--samples", "100000000"], "argument --samples: got '100000000', allowed: a whole number from 1 to 1,024"),
])
def test_sample_py_bounds_what_it_draws_in_one_line(tmp_path, capsys, args, message):
    """sample.py draws every byte in one loop nothing stops: --length and --samples have a stated bound (the
    length's message says why), refused before anything loads (no OverflowError, no hours-long loop)."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}")
    with pytest.raises(SystemExit) as info:
        sample_cli.parser().parse_args([str(tmp_path), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("sample: error: " + message), err


def test_sample_py_refuses_a_file_or_unreadable_checkpoints_as_run_dir_in_one_line(text_run, tmp_path, capsys):
    sample = sample_cli  # rnnlab.sample
    run = copied(text_run[0], tmp_path / "run")
    capsys.readouterr()  # the training's own lines
    loaded = load_run(run)  # what sample.py samples from: the carried state's train state, bit for bit Orbax's
    assert isinstance(loaded.state, CarryTrainState) and loaded.step == 2
    saved = saved_state(run, 2)
    assert_same_tree(loaded.params, saved["params"])
    assert_same_tree(loaded.state.carry, saved["carry"])
    with pytest.raises(SystemExit) as info:  # a file is not a run dir
        sample.parser().parse_args([str(run / "results.json")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"sample: error: argument RUN_DIR: '{run / 'results.json'}' is not a run dir of train.py")
    for stored in (run / "checkpoints" / "2" / "state").rglob("*"):  # every file of the saved state damaged
        if stored.is_file():
            stored.write_bytes(b"damaged")
    assert sample.main([str(run), "--length", "5"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"sample: error: argument RUN_DIR: no checkpoint in {run / 'checkpoints'} can be restored")


@pytest.mark.slow("end-to-end")
def test_sample_py_prints_text_from_a_trained_run_and_refuses_bad_options_in_one_line(tmp_path):
    run = tmp_path / "run"
    trained = run_train([*TEXT_FIXTURE_DATA, "model=lstm", "hidden_dim=8", "num_layers=1", "batch_size=4",
                         "data.seq_len=8", "data.eval_streams=2", "steps=4", "device.num_devices=1",
                         f"hydra.run.dir={run}"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    script = [sys.executable, "-m", "rnnlab.sample", str(run)]
    done = subprocess.run([*script, "--prompt", "ROMEO.", "--length", "30", "--temperature", "0.8", "--top-k", "20",
                           "--seed", "1"], env=train_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ROMEO.") and len(done.stdout.encode("utf-8", "replace")) >= len("ROMEO.") + 2
    for bad in (["--temperature", "-1"], ["--top-k", "300"], ["--length", "0"]):
        refused = subprocess.run([*script, *bad], env=train_env(), capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and refused.stdout == ""
        (line,) = refused.stderr.splitlines()
        assert line.startswith("sample: error: argument " + bad[0])


@pytest.mark.slow("end-to-end")
def test_a_killed_text_run_resumes_bit_for_bit_with_its_carried_state(tmp_path):
    args = [*TEXT_FIXTURE_DATA, "model=lstm", "hidden_dim=8", "num_layers=1", "batch_size=4", "data.seq_len=8",
            "data.eval_streams=2", "steps=40", "eval_every=20", "log_every=5", "checkpoint.every=1",
            "device.num_devices=1", "device.steps_per_dispatch=1"]
    whole = run_train([*args, f"hydra.run.dir={tmp_path / 'whole'}"], cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={cut}"], cwd=tmp_path,
                            env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # once step 15 is logged, earlier saves have completed
        if "step 15/40" in line:
            break
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train([*args, f"hydra.run.dir={cut}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    a, b = saved_state(tmp_path / "whole", 40), saved_state(cut, 40)
    assert_same_tree(a, b)
    assert "carry" in a
    results = json.loads((cut / "results.json").read_text())
    assert results["test_bpc"] is not None and results["eval_metrics"]["bpc_reset"] is not None
