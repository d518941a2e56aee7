"""oneDNN's LSTM layer (`model.recurrence=onednn`, rnnlab/onednn.py) against NumPy's equations and the
XLA path, values and gradients; `auto` by shape; the fallback and its notice; the config errors.

The kernel comes with the `onednn` extra, which the full tier installs (.ci/run): the tests that run
it are in that tier, and under CI a kernel that does not build fails them instead of skipping."""

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config
from rnnlab import models, onednn
from rnnlab.config import ConfigError
from rnnlab.models import RecurrentLayer, build_model
from test_lstm_gru import init, numpy_lstm, random_like


def require_kernel():
    ok, why = onednn.available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"oneDNN's kernel did not build or load: {why}")
        pytest.skip(why)


def numpy_lstm_grads(x, w_xh, b, w_hh, d_hs):
    """Backpropagation through time of `numpy_lstm` (x: [B, T, I]) for the cotangent d_hs: [B, T, H]:
    (dx, dW_xh, db, dW_hh), written from the equations step by step."""
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    batch, steps, hid = x.shape[0], x.shape[1], w_hh.shape[0]
    h, c = np.zeros((batch, hid)), np.zeros((batch, hid))
    tape = []
    for t in range(steps):
        i, f, g, o = np.split(x[:, t] @ w_xh + b + h @ w_hh, 4, axis=-1)
        i, f, g, o = sig(i), sig(f), np.tanh(g), sig(o)
        c_new = f * c + i * g
        tape.append((h, c, i, f, g, o, c_new))
        h, c = o * np.tanh(c_new), c_new
    dx, dw_xh, db, dw_hh = np.zeros_like(x), np.zeros_like(w_xh), np.zeros_like(b), np.zeros_like(w_hh)
    dh_next, dc_next = np.zeros((batch, hid)), np.zeros((batch, hid))
    for t in reversed(range(steps)):
        h_prev, c_prev, i, f, g, o, c_t = tape[t]
        dh = d_hs[:, t] + dh_next
        tc = np.tanh(c_t)
        dc = dh * o * (1 - tc**2) + dc_next
        da = np.concatenate([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g**2), dh * tc * o * (1 - o)], -1)
        dx[:, t] = da @ w_xh.T
        dw_xh += x[:, t].T @ da
        db += da.sum(0)
        dw_hh += h_prev.T @ da
        dh_next, dc_next = da @ w_hh.T, dc * f
    return dx, dw_xh, db, dw_hh


@pytest.mark.slow("extra")
def test_kernel_matches_numpy_values_and_gradients():
    require_kernel()
    rng = np.random.default_rng(0)
    batch, steps, inputs, hid = 3, 9, 5, 4
    x, w_xh, b, w_hh, d_hs = (rng.normal(size=s, scale=0.5) for s in
                              [(batch, steps, inputs), (inputs, 4 * hid), (4 * hid,), (hid, 4 * hid), (batch, steps, hid)])
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    hs, vjp = jax.vjp(jax.jit(onednn.lstm), f32(x.swapaxes(0, 1)), f32(w_xh), f32(w_hh), f32(b))
    dx, dw_xh, dw_hh, db = vjp(f32(d_hs.swapaxes(0, 1)))
    np.testing.assert_allclose(np.asarray(hs).swapaxes(0, 1), numpy_lstm(x, w_xh, b, w_hh), rtol=1e-5, atol=1e-5)
    want = numpy_lstm_grads(x, w_xh, b, w_hh, d_hs)
    got = (np.asarray(dx).swapaxes(0, 1), dw_xh, db, dw_hh)
    for name, g, w in zip(("dx", "dW_xh", "db", "dW_hh"), got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_numpy_gradients_are_the_gradients_of_numpy_lstm():
    """The hand-written NumPy reference above against finite differences of `numpy_lstm` (float64)."""
    rng = np.random.default_rng(1)
    x, w_xh, b, w_hh, d_hs = (rng.normal(size=s, scale=0.5) for s in [(2, 4, 3), (3, 8), (8,), (2, 8), (2, 4, 2)])
    grads = numpy_lstm_grads(x, w_xh, b, w_hh, d_hs)
    args = [x, w_xh, b, w_hh]
    for k, grad in enumerate(grads):
        flat = args[k].reshape(-1)
        for j in range(0, flat.size, 3):
            old = flat[j]
            flat[j] = old + 1e-6
            up = np.sum(numpy_lstm(*args) * d_hs)
            flat[j] = old - 1e-6
            down = np.sum(numpy_lstm(*args) * d_hs)
            flat[j] = old
            assert abs((up - down) / 2e-6 - grad.reshape(-1)[j]) < 1e-6


def model_config(*overrides, **fields):
    return dataclasses.replace(compose_config(["model=lstm", *overrides]).model, **fields)


@pytest.mark.slow("extra")
@pytest.mark.parametrize("inputs", ["float", "token ids"])
def test_model_with_onednn_equals_the_xla_path(inputs):
    """A 2-layer model (a layer scan after the first layer): loss and every gradient as custom_vjp gives them,
    on float inputs (the projection folded into layer 0) and on token ids (oneDNN gets the gathered x P + c)."""
    require_kernel()
    rng = np.random.default_rng(3)
    if inputs == "float":
        x, input_dim = jnp.asarray(rng.normal(size=(4, 6, 3)), jnp.float32), None
    else:
        x, input_dim = jnp.asarray(rng.integers(0, 7, size=(4, 6)), jnp.int32), 7
    y = jnp.asarray(rng.normal(size=(4, 6, 2)), jnp.float32)
    results = {}
    for recurrence in ("onednn", "custom_vjp"):
        model = build_model(model_config("hidden_dim=8", "num_layers=2", recurrence=recurrence), 2, "cpu", input_dim)
        params = random_like(init(model, x), seed=2)
        loss = lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        results[recurrence] = jax.jit(jax.value_and_grad(loss))(params)
        jaxpr = str(jax.make_jaxpr(loss)(params))
        assert (onednn.FORWARD in jaxpr) == (recurrence == "onednn")
    (l1, g1), (l2, g2) = results["onednn"], results["custom_vjp"]
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow("extra")
def test_auto_runs_onednn_for_wide_layers_only():
    require_kernel()
    for batch, hidden, wanted in [(onednn.MIN_BATCH, onednn.MIN_HIDDEN, True), (onednn.MIN_BATCH - 1, onednn.MIN_HIDDEN, False),
                                  (onednn.MIN_BATCH, onednn.MIN_HIDDEN - 1, False)]:
        layer = RecurrentLayer(hidden_dim=hidden, cell="lstm", recurrence="auto")
        x = jnp.zeros((2, batch, 3))
        params = jax.eval_shape(layer.init, jax.random.key(0), x)
        jaxpr = str(jax.make_jaxpr(lambda p: layer.apply(p, x))(params))
        assert (onednn.FORWARD in jaxpr) == wanted, (batch, hidden)


def test_onednn_falls_back_to_xla_with_one_notice(monkeypatch, caplog):
    """Where the kernel cannot run, the model is the custom_vjp one and the log says why, once."""
    monkeypatch.setattr(onednn, "available", lambda: (False, "no C++ compiler (g++) on PATH"))
    models._notice_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="rnnlab.models"):
        for _ in range(2):
            assert build_model(model_config(recurrence="onednn"), 2, "cpu").config.recurrence == "custom_vjp"
    notices = [r.getMessage() for r in caplog.records if "onednn" in r.getMessage()]
    assert notices == ["model.recurrence=onednn: no C++ compiler (g++) on PATH; running model.recurrence=custom_vjp (XLA) instead"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rnnlab.models"):  # auto: quiet where its width would not take oneDNN
        assert build_model(model_config("hidden_dim=8", recurrence="auto"), 2, "cpu").config.recurrence == "custom_vjp"
        assert build_model(model_config("hidden_dim=256", recurrence="auto"), 2, "gpu").config.recurrence == "custom_vjp"
        assert build_model(model_config(recurrence="onednn"), 2, "gpu").config.recurrence == "custom_vjp"
        assert build_model(model_config("hidden_dim=256", recurrence="auto"), 2, "cpu").config.recurrence == "custom_vjp"
    assert [r.getMessage() for r in caplog.records] == [
        "model.recurrence=onednn: oneDNN's kernel runs on CPU, not gpu; running model.recurrence=custom_vjp (XLA) instead",
        "model.recurrence=auto: no C++ compiler (g++) on PATH; running model.recurrence=custom_vjp (XLA) instead"]


def test_the_default_lstm_is_auto_and_bad_choices_name_the_key():
    assert compose_config(["model=lstm"]).model.recurrence == "auto"
    with pytest.raises(ConfigError, match=r"key 'model.recurrence': got 'onednn', but cell 'gru' has no oneDNN kernel; "
                                          r"allowed: autodiff, custom_vjp \(onednn and auto: lstm\)"):
        compose_config(["model=gru", "model.recurrence=onednn"])
    with pytest.raises(ConfigError, match=r"key 'model.dtype': got 'bfloat16', but model.recurrence=onednn runs float32 only"):
        compose_config(["model=lstm", "model.recurrence=onednn", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"key 'model.remat': got true"):
        compose_config(["model=lstm", "model.remat=true"])


@pytest.mark.slow("extra")
def test_a_kernel_that_cannot_compile_says_why(monkeypatch, tmp_path):
    """A failed build is a reason, not an exception: the run goes on with the XLA path."""
    prefix = onednn.library_prefix()
    if prefix is None:
        pytest.skip("the onednn extra is not installed")
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="compiling onednn_lstm.cc failed"):
        onednn.build(prefix)
    assert not list(tmp_path.rglob("*.tmp"))
