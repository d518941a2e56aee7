"""`python train.py --help` prints rnnlab's own help (conf/hydra/help/rnnlab.yaml), not Hydra's:
what rnnlab is, commands that run, every config group's options, the keys and the exit codes."""

import re
import shlex

import pytest

from conftest import ROOT, compose_config, run_train


@pytest.fixture(scope="module")
def help_text(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("help")
    proc = run_train(["--help"], cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(cwd.iterdir())  # nothing trained: no outputs/ run dir
    assert "Traceback" not in proc.stderr
    return proc.stdout


def section(text, title):
    """The lines under `== title ... ==`, up to the next blank line."""
    return text.split(f"== {title}", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0].splitlines()


def test_help_says_what_rnnlab_does_and_fits_100_columns(help_text):
    assert help_text.startswith("rnnlab trains, sweeps and measures recurrent networks")
    assert "is powered by Hydra" not in help_text  # Hydra's default help is replaced
    assert max(len(line) for line in help_text.splitlines()) <= 100
    keys = ["seed", "steps", "batch_size", "hidden_dim", "num_layers", "log_every", "eval_every", "eval_batches",
            "on_nonfinite", "imports", "checkpoint.*", "profile.*", "log.*", "distributed.*"]
    listed = [line.split()[0] for line in section(help_text, "Top-level keys")]
    assert all(key in listed for key in keys), listed


def test_help_lists_each_exit_code_of_train_py(help_text):
    """The codes are rnnlab.exit_codes' constants (every command's, defined once there)."""
    from rnnlab import exit_codes

    defined = {v for k, v in vars(exit_codes).items() if k.isupper()}
    listed = {int(m) for m in re.findall(r"^  (\d+) +\S", "\n".join(section(help_text, "Exit codes")), re.M)}
    assert listed == defined | {0}
    for code, meaning in [(0, "done"), (1, "a bug"), (2, "bad input"), (3, "diverged"), (74, "cannot be written"),
                          (75, "preempted"), (130, "aborted")]:
        assert re.search(rf"^  {code} +.*{meaning}", help_text, re.M), code


def test_help_lists_every_option_found_in_conf(help_text):
    """Options come from the config dirs, so a new cell, task or preset shows without editing the help."""
    groups, group = {}, None
    for line in section(help_text, "Config groups"):
        if line.startswith(" " * 20):  # a long group's options go on, indented past the names
            groups[group] += line.split(",")
        else:
            name, _, options = line.partition(":")
            group = name.strip()
            groups[group] = options.split(",")
    groups = {g: [o.strip() for o in opts if o.strip()] for g, opts in groups.items()}
    expected = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in (ROOT / "conf").iterdir()
                if d.is_dir() and d.name != "hydra"}
    assert {g: opts for g, opts in groups.items() if g in expected} == expected
    assert "hydra/launcher" in groups


def test_help_examples_compose(help_text):
    """Each `python train.py ...` example composes and validates (a sweep: its first job)."""
    examples = [line.strip() for line in section(help_text, "Examples")]
    commands = [shlex.split(line, comments=True)[2:] for line in examples if line.startswith("python train.py")]
    assert len(commands) >= 5 and any("-m" in args for args in commands)
    assert any(a.startswith("experiment=") for args in commands for a in args)
    assert any(line.startswith("tensorboard --logdir") for line in examples)
    for args in commands:
        overrides = [a.split(",")[0] for a in args if not a.startswith("-") and a != "job"]
        compose_config(overrides)
