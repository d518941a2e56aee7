"""Nothing unstoppable in an evaluation (issue 72): a long length runs in segments from the host, chunk by chunk,
so SIGTERM and Ctrl-C end it within seconds, between chunks and between lengths (exit 75, the checkpoint of its
step and results.json written; a rerun evaluates again; a second Ctrl-C aborts, exit 130). A length beyond reason
is refused with one line naming the key: past 10^8 steps when the config is read, past `eval_max_minutes` once its
first segments' speed predicts its time. `python -m rnnlab.eval_long` does the same with its options."""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, TINY, compose_config, tiny_config, train_env
from rnnlab import config as cfg
from rnnlab import eval_long, loop, steps, tasks
from rnnlab.checkpoint import PreemptionGuard, saved_steps
from rnnlab.models import build_model
from rnnlab.trainer import train_and_evaluate


def segmented(config, length, segment_len):
    """A state and the `Evaluator` of `config`'s task at `length` in segments of `segment_len`."""
    task = tasks.make_task(config.data)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    state = steps.create_train_state(jax.random.key(1), model, task.example_inputs(1), tx)
    dp = steps.parallel.DataParallel(jax.devices()[:1], config.device.strategy)
    evaluator = steps.make_segment_evaluator(config, task.with_seq_len(length), config.batch_size, dp, segment_len)
    return dp, dp.replicate(state), evaluator


@pytest.mark.slow("long")
def test_a_segmented_eval_stops_between_its_chunks_and_scores_the_same_in_any_chunks(monkeypatch):
    config = tiny_config("data=parity", "model=gru", "eval_batches=2")
    dp, state, evaluator = segmented(config, 203, 4)  # 50 segments of 4 steps a batch, then 3 steps
    whole = dp.to_host(evaluator.segments.run(state, evaluator.batches))  # in chunks that grow to a second
    counts = []
    chunk = evaluator.segments._chunk
    evaluator.segments._chunk = lambda *args: (counts.append(int(np.asarray(args[-1]).reshape(-1)[0])), chunk(*args))[1]
    monkeypatch.setattr(steps, "CHUNK_SECONDS", 1e-9)  # from now on every chunk one segment
    evaluator.segments._count = 1
    asked = []
    with pytest.raises(steps.EvalInterrupted):
        evaluator.segments.run(state, evaluator.batches, lambda: asked.append(1) or len(asked) > 3)
    assert counts == [1, 1, 1]  # asked before each chunk: the fourth answer stopped it
    counts.clear()
    assert dp.to_host(evaluator.segments.run(state, evaluator.batches)) == whole  # the same scores in any chunks
    assert counts == [1] * (2 * 50)


@pytest.mark.slow("long")
def test_an_evaluation_stops_between_its_lengths():
    config = tiny_config("data=parity", "model=gru", "data.eval_seq_lens=[6,9]")
    task = tasks.make_task(config.data)
    fns = steps.make_step_functions(config, task, jax.devices()[:1], 1)
    model = build_model(config.model, task.output_dim, "cpu", task.input_dim)
    tx, _ = steps.make_optimizer(config.optimizer, config.steps)
    state = fns.dp.replicate(steps.create_train_state(jax.random.key(1), model, task.example_inputs(1), tx))
    asked = []
    with pytest.raises(steps.EvalInterrupted):
        fns.evaluate(state, lambda: asked.append(1) or len(asked) > 1)
    assert len(asked) == 2  # the first length evaluated, the second not started
    assert set(fns.evaluate(state)[0]) == {6, 9}


@pytest.mark.slow("long")
def test_a_length_whose_measured_time_is_past_the_budget_is_refused_in_one_line(monkeypatch, caplog):
    monkeypatch.setattr(steps, "MEASURE_SECONDS", 0.0)  # predict from the first timed chunk
    monkeypatch.setattr(steps, "NOTE_SECONDS", 0.0)
    dp, state, evaluator = segmented(tiny_config("data=parity", "model=gru", "eval_max_minutes=1e-9"), 4000, 4)
    with caplog.at_level("INFO", logger="rnnlab.trainer"), pytest.raises(steps.EvalTooLongError) as info:
        evaluator.segments.run(state, evaluator.batches)
    message = str(info.value)
    assert message.startswith("key 'data.eval_seq_lens': evaluating length 4000 would take about ")
    assert "tokens/s), more than eval_max_minutes=1e-09; allowed: shorter lengths" in message and "\n" not in message
    assert message.endswith("or a larger eval_max_minutes (null: no limit)")
    assert "eval at length 4000: about " in caplog.text and " tokens/s)" in caplog.text
    dp, state, evaluator = segmented(tiny_config("data=parity", "model=gru", "eval_max_minutes=null"), 400, 4)
    assert 0 <= dp.to_host(evaluator.segments.run(state, evaluator.batches))[0]["accuracy"] <= 1  # no limit


@pytest.mark.parametrize("overrides,message", [
    (["data.eval_seq_lens=[100,1000000000]"], "key 'data.eval_seq_lens': got 1000000000, allowed: lengths up to "
                                              "100,000,000 (10^8 steps take hours even in segments;"),
    (["eval_max_minutes=0"], "key 'eval_max_minutes': got 0.0, must be > 0"),
    (["eval_max_minutes=-5"], "key 'eval_max_minutes': got -5.0, must be > 0"),
])
def test_eval_lengths_beyond_reason_and_bad_budgets_are_refused_when_the_config_is_read(overrides, message):
    with pytest.raises(cfg.ConfigError) as info:
        compose_config(["data=parity", "data.eval_segment_len=16", *overrides])
    assert message in str(info.value) and "\n" not in str(info.value)
    compose_config(["data=parity", "data.eval_segment_len=16", "data.eval_seq_lens=[100000000]",
                    "eval_max_minutes=null"])  # the longest allowed, with no time limit


@pytest.mark.parametrize("data,allowed", [
    ("parity", "or data.eval_segment_len=4096 (longer lengths run in segments of it"),
    ("copy", "allowed: shorter lengths or fewer eval_batches (the copy task is not evaluated in segments)"),
])
def test_an_eval_length_too_long_to_run_whole_is_refused_naming_the_key(tmp_path, data, allowed):
    from rnnlab.memory import OutOfMemoryError

    config = tiny_config(f"data={data}", "data.seq_len=12", "data.eval_seq_lens=[12,100000000]", "batch_size=64",
                         "hidden_dim=32", "checkpoint.enabled=false")  # 50 GB of inputs, 800 GB of a layer's outputs
    with pytest.raises(OutOfMemoryError) as info:
        train_and_evaluate(config, tmp_path)
    message = str(info.value)
    assert message.startswith("key 'data.eval_seq_lens': evaluating 100000000 steps whole keeps eval_batches=1")
    assert allowed in message and "\n" not in message
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("overrides, free, message", [
    # A whole length's forward holds each layer's input term (3H for a GRU) and output, and the logits: about
    # 1.1 KB a step for 8 examples at H=8, where a layer's output alone (what the check counted) is 256 bytes.
    (["data.eval_seq_lens=[6,1000000]"], 2.0**29, "key 'data.eval_seq_lens': evaluating 1000000 steps whole keeps "),
    # In segments: the state, and a segment's forward (8 examples x 2,048 steps: 16,384 tokens a device).
    (["data.eval_seq_lens=[6,1000000]", "data.eval_segment_len=4096"], 2.0**22,
     "key 'data.eval_segment_len': evaluating 1000000 steps in segments of 2048 steps takes about "),
])
def test_the_memory_check_counts_an_evaluations_forward_naming_its_key(tmp_path, monkeypatch, overrides, free,
                                                                       message):
    from rnnlab import memory
    from rnnlab.checkpoint import Checkpointer
    from rnnlab.setup import plan

    monkeypatch.setattr(memory, "free_bytes", lambda devices: free)
    config = tiny_config("data=parity", "model=gru", *overrides)
    checkpointer = Checkpointer(tmp_path / "checkpoints", 0, 1)
    try:
        with pytest.raises(memory.OutOfMemoryError) as info:
            plan(config, tmp_path, jax.devices()[:1], checkpointer)
    finally:
        checkpointer.close()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert "hidden_dim" not in str(info.value)


class StopDuringEval(PreemptionGuard):
    """A guard whose stop request comes once an evaluation in segments has asked twice (as a SIGTERM then would)."""

    asked = 0

    @property
    def requested(self):
        return "SIGTERM" if StopDuringEval.asked > 2 else None

    @requested.setter
    def requested(self, value):
        pass


@pytest.mark.slow("long")
def test_a_stop_during_an_eval_ends_the_run_preempted_with_its_checkpoint_and_a_rerun_evaluates(tmp_path, monkeypatch):
    config = tiny_config("data=parity", "model=gru", "data.eval_seq_lens=[6,300]", "data.eval_segment_len=16",
                         "steps=4", "eval_every=4", "checkpoint.every=4")
    run = steps.SegmentedEval.run

    def counting(self, state, batches, should_stop=None):
        def asked():
            StopDuringEval.asked += 1
            return should_stop()
        return run(self, state, batches, asked)

    monkeypatch.setattr(loop, "PreemptionGuard", StopDuringEval)
    monkeypatch.setattr(steps.SegmentedEval, "run", counting)
    results = train_and_evaluate(config, tmp_path)
    assert results["status"] == "preempted" and results["step"] == 4 and StopDuringEval.asked == 3
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "preempted"
    assert saved_steps(tmp_path / "checkpoints") == {4}  # the checkpoint of the step it evaluated
    assert results["eval_by_len"]["300"]["accuracy"] is None  # an interrupted eval reports nothing
    monkeypatch.undo()
    results = train_and_evaluate(config, tmp_path)  # the same command again: the restored state evaluated
    assert results["status"] == "completed" and results["step"] == 4
    assert 0 <= results["eval_by_len"]["300"]["accuracy"] <= 1


@pytest.mark.slow("long")
def test_an_eval_refused_at_run_time_keeps_its_checkpoint_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(steps, "MEASURE_SECONDS", 0.0)
    config = tiny_config("data=parity", "model=gru", "data.eval_seq_lens=[6,3000]", "data.eval_segment_len=8",
                         "steps=4", "eval_every=4", "checkpoint.every=4", "eval_max_minutes=1e-9")
    with pytest.raises(steps.EvalTooLongError, match="^key 'data.eval_seq_lens': evaluating length 3000 would take"):
        train_and_evaluate(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "failed" and "eval_max_minutes" in results["error"] and results["step"] == 4
    assert saved_steps(tmp_path / "checkpoints") == {4}


# rnnlab.eval_long: every option's bad value exits 2 with one line naming it and what is allowed.

def trained_run(run, *overrides, train=True):
    """A tiny run of `overrides` with a checkpoint, trained in `run` as train.py would, for rnnlab.eval_long.
    With train=False only what eval_long reads before it restores anything: the composed config and a step's
    folder under checkpoints/ (its refusals of options and of runs come before any restore)."""
    from omegaconf import OmegaConf

    config = tiny_config(*overrides, "steps=2", "eval_every=2", "checkpoint.every=2")
    if train:
        train_and_evaluate(config, run)
    else:
        (run / "checkpoints" / "2").mkdir(parents=True)
    (run / ".hydra").mkdir()  # what Hydra writes for train.py
    OmegaConf.save(OmegaConf.create(json.loads(json.dumps(cfg.to_dict(config)))), run / ".hydra" / "config.yaml")
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny parity run with a checkpoint, for rnnlab.eval_long."""
    return trained_run(tmp_path_factory.mktemp("trained") / "run", "data=parity", "model=gru")


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """`trained`'s run dir as eval_long's refusals read it (config and a checkpoint's folder), not trained."""
    return trained_run(tmp_path_factory.mktemp("untrained") / "run", "data=parity", "model=gru", train=False)


BAD_OPTIONS = [
    (["--lengths", "0"], "argument --lengths: got 0, allowed: a whole number from 1 to 100,000,000 steps"),
    (["--lengths", "-3"], "argument --lengths: got -3, allowed: a whole number from 1"),
    (["--lengths", "ten"], "argument --lengths: got 'ten', allowed: a whole number from 1"),
    (["--lengths", "1000000000"], "argument --lengths: got 1,000,000,000, allowed: a whole number from 1 to 100,000,000"),
    (["--lengths", "10", "--segment", "0"], "argument --segment: got 0, allowed: a whole number from 1 to 65,536"),
    (["--lengths", "10", "--segment", "-5"], "argument --segment: got -5, allowed: a whole number from 1 to 65,536"),
    (["--lengths", "10", "--segment", "4k"], "argument --segment: got '4k', allowed: a whole number from 1 to 65,536"),
    (["--lengths", "10", "--sequences", "0"], "argument --sequences: got 0, allowed: a whole number from 1 to 16,384"),
    (["--lengths", "10", "--max-minutes", "0"], "argument --max-minutes: got '0', allowed: a number of minutes > 0"),
    (["--lengths", "10", "--max-minutes", "soon"], "argument --max-minutes: got 'soon', allowed: a number of minutes"),
    (["--lengths", "10", "--out", "/nonexistent-dir/x.csv"], "argument --out: cannot write"),
    (["--segment", "8"], "the following arguments are required: --lengths"),
]


@pytest.mark.parametrize("args,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_eval_long_refuses_a_bad_option_in_one_line(untrained, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        eval_long.parser().parse_args([str(untrained), *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith("eval_long: error: ") and message in err


def test_eval_long_refuses_a_missing_run_dir_and_a_metric_its_task_lacks(untrained, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        eval_long.parser().parse_args([str(tmp_path / "missing"), "--lengths", "10"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "argument RUN_DIR: " in err and "not a run dir" in err
    assert eval_long.main([str(untrained), "--lengths", "10", "--metric", "mse"]) == 2
    err = capsys.readouterr().err
    assert err == "eval_long: error: argument --metric: got 'mse', allowed for the parity task of " \
                  f"{untrained}: loss, accuracy\n"


def test_eval_long_refuses_a_text_run_in_one_line_naming_what_evaluates_it(tmp_path, capsys):
    """A data=text run (its train state carries its streams' model state) has no lengths: refused before anything
    is restored or compiled, pointing to the run's own evaluation (data.eval_streams), not a checkpoint error."""
    from conftest import TEXT_FIXTURE_DATA

    run = trained_run(tmp_path / "run", *TEXT_FIXTURE_DATA, "model=lstm", "num_layers=1", "batch_size=4",
                      "data.seq_len=8", "data.eval_streams=2", train=False)
    assert eval_long.main([str(run), "--lengths", "1000"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"eval_long: error: argument RUN_DIR: {run} trained data=text, which has no lengths")
    assert "data.eval_streams" in err and "allowed: " in err and "move them away" not in err


# End to end: train.py and rnnlab.eval_long signalled during a long evaluation.

LONG = [*[o for o in TINY if not o.startswith(("steps", "eval_every", "checkpoint"))], "data=parity", "model=gru",
        "steps=4", "eval_every=4", "checkpoint.every=4", "data.eval_segment_len=16", "data.eval_seq_lens=[100000000]"]


def start(args, cwd):
    return subprocess.Popen(args, cwd=cwd, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def read_until(proc, text, timeout=240):
    """Lines of the process's output until one holds `text` (or it ends); returns them."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text in line or time.time() > deadline:
            break
    return "".join(seen)


def ends_within(proc, seconds):
    started = time.time()
    out, _ = proc.communicate(timeout=seconds)
    return out, time.time() - started


@pytest.mark.slow("end-to-end")
def test_train_py_stops_a_long_eval_within_seconds_and_a_rerun_evaluates_again(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), *LONG, "eval_max_minutes=null", f"hydra.run.dir={run}"]
    proc = start(command, tmp_path)
    seen = read_until(proc, "eval at length 100000000: about ")
    assert "eval at length" in seen, seen[-3000:]
    proc.send_signal(signal.SIGTERM)
    out, seconds = ends_within(proc, 60)
    assert proc.returncode == 75 and seconds < 20, (seconds, out[-3000:])
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "preempted" and results["step"] == 4
    assert saved_steps(run / "checkpoints") == {4}

    # The same command evaluates the restored step again, and a second Ctrl-C during that eval's chunk aborts it.
    # The second is sent once the first is seen handled (CPython runs a handler once for signals that arrive before
    # it runs); if the chunk in progress ends first, the run stops as preempted instead (exit 75, or 130 when the
    # second lands on the way out), and the next try resumes it.
    for attempt in range(4):
        proc = start(command, tmp_path)
        seen = read_until(proc, "eval at length 100000000: about ")
        assert "resumed from" in seen and "eval at length" in seen, seen[-3000:]
        proc.send_signal(signal.SIGINT)
        seen = read_until(proc, "SIGINT received")
        proc.send_signal(signal.SIGINT)
        out, seconds = ends_within(proc, 60)
        status = json.loads((run / "results.json").read_text())["status"]
        assert (proc.returncode, status) in {(130, "aborted"), (75, "preempted"), (130, "preempted")} \
            and seconds < 20, \
            (proc.returncode, status, seconds, seen[-1000:] + out[-3000:])
        assert saved_steps(run / "checkpoints") == {4}
        if status == "aborted":
            break
    assert status == "aborted" and "aborted by a second interrupt" in out, (attempt, out[-3000:])


@pytest.mark.slow("end-to-end")
def test_train_py_refuses_an_eval_beyond_reason_in_one_line(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *LONG, "data.eval_seq_lens=[1000000000]",
                           f"hydra.run.dir={run}"], cwd=tmp_path, env=train_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "rnnlab: error: key 'data.eval_seq_lens': got 1000000000, allowed: lengths up to 100,000,000"), proc.stderr
    assert not (run / "checkpoints").exists() or not saved_steps(run / "checkpoints")  # before training
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *LONG, "eval_max_minutes=0.5",
                           f"hydra.run.dir={run}"], cwd=tmp_path, env=train_env(), capture_output=True, text=True,
                          timeout=300)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith(
        "rnnlab: error: key 'data.eval_seq_lens': evaluating length 100000000 would take about "), proc.stderr[-3000:]
    assert "more than eval_max_minutes=0.5" in line and "Traceback" not in proc.stderr
    assert json.loads((run / "results.json").read_text())["status"] == "failed"
    assert saved_steps(run / "checkpoints") == {4}  # the training is kept


@pytest.mark.slow("end-to-end")
def test_eval_long_predicts_refuses_and_stops_within_seconds(trained, tmp_path):
    script = [sys.executable, "-m", "rnnlab.eval_long", str(trained), "--segment", "16", "--sequences", "8"]
    proc = subprocess.run([*script, "--lengths", "0"], env=train_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == ("eval_long: error: argument --lengths: got 0, allowed: a whole "
                                                    "number from 1 to 100,000,000 steps (10^8 steps take hours even "
                                                    "in segments)\n")
    proc = subprocess.run([*script, "--lengths", "100000000", "--max-minutes", "0.5"], env=train_env(),
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("eval_long: error: argument --lengths: evaluating length "
                                                         "100,000,000 of 8 sequences would take about "), proc.stderr
    assert "more than --max-minutes=0.5" in lines[-1]
    out = tmp_path / "long.csv"
    proc = start([*script, "--lengths", "40", "100000000", "--max-minutes", "none", "--out", str(out)], tmp_path)
    seen = read_until(proc, "eval at length 100000000: about ")
    assert "eval at length" in seen, seen
    proc.send_signal(signal.SIGTERM)
    output, seconds = ends_within(proc, 60)
    assert proc.returncode == 75 and seconds < 20, (seconds, output)
    assert "eval_long: stopped by SIGTERM between segments: 1 row(s) done" in output
    assert [line.split(",")[2] for line in out.read_text().splitlines()[1:]] == ["40"]  # the length done, written
