"""The block each family trains in (`rnnlab.blocks`): every channel MLP against NumPy, the residual
block with and without one, each model config's declared block, Mamba's block and initialisation
against the reference implementation's (state-spaces/mamba, `mamba_simple.py`), and the refusals."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose_config
from rnnlab.blocks import ChannelMLP, mlp_width
from rnnlab.cells import CELLS, cell_names
from rnnlab.config import ConfigError
from rnnlab.models import build_model


def gelu(v):  # flax's nn.gelu default: the tanh approximation
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def silu(v):
    return v / (1 + np.exp(-v))


def rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def numpy_mlp(kind, x, p):
    """The MLPs as their papers write them, float64."""
    dense = lambda name, v: v @ p[name]["kernel"] + p[name].get("bias", 0)  # noqa: E731
    if kind == "gelu":
        return dense("down", gelu(dense("up", x)))
    act = {"geglu": gelu, "swiglu": silu}[kind]
    return dense("down", act(dense("gate", x)) * dense("up", x))


def f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


@pytest.mark.parametrize("kind, expand, bias", [("gelu", 4, True), ("gelu", 2, False), ("geglu", 3, False),
                                                ("swiglu", 8 / 3, False), ("swiglu", 2, True)])
def test_each_mlp_matches_numpy(kind, expand, bias):
    x = np.random.default_rng(0).normal(size=(3, 5, 6)).astype(np.float32)
    mlp = ChannelMLP(kind, expand, bias)
    params = mlp.init(jax.random.key(0), x)["params"]
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32), params)
    width = mlp_width(expand, 6)
    assert params["up"]["kernel"].shape == (6, width) and ("bias" in params["down"]) == bias
    assert ("gate" in params) == (kind != "gelu")
    np.testing.assert_allclose(mlp.apply({"params": params}, x), numpy_mlp(kind, x, f64(params)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mlp", ["none", *(pytest.param(mlp, marks=pytest.mark.slow("cross-product"))
                                          for mlp in ("gelu", "swiglu"))])
def test_residual_block_matches_numpy(mlp):
    """One attention layer in a residual block: x + attn(norm(x)), then x + MLP(norm(x)) unless none."""
    from cells.test_attention_mamba import numpy_attention

    H = 8
    config = compose_config(["model=attention", f"hidden_dim={H}", "num_layers=1", "model.num_heads=2",
                             f"model.mlp={mlp}"]).model
    model = build_model(config, output_dim=2, platform="cpu")
    x = np.random.default_rng(6).normal(size=(2, 5, 3)).astype(np.float32)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    rng = np.random.default_rng(7)
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32), params)
    got = jax.jit(model.apply)({"params": params}, x)
    p = f64(params)
    blk = p["stack"]["layer_0"]
    h = x.astype(np.float64) @ p["input_proj"]["kernel"] + p["input_proj"]["bias"]
    h = h + numpy_attention(rms_norm(h, blk["norm_0"]["scale"]), blk["recurrence"], num_heads=2)
    if mlp == "none":
        assert set(blk) == {"norm_0", "recurrence"}
    else:
        h = h + numpy_mlp(mlp, rms_norm(h, blk["norm_1"]["scale"]), blk["mlp"])
    want = rms_norm(h, p["final_norm"]["scale"]) @ p["readout"]["kernel"] + p["readout"]["bias"]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


# Each family's declared block (conf/model/<cell>.yaml): (block, mlp, expand, bias).
PAPER_BLOCKS = {
    "attention": ("residual", "gelu", 4, True),  # GPT-2, Zoology's TransformerBlock
    "mamba": ("residual", "none", None, None),  # Mamba's blocks: no MLP
    "mamba2": ("residual", "none", None, None),  # Mamba-2's too (d_intermediate=0)
    "mlstm": ("residual", "none", None, None),  # the xLSTM's mLSTM block: up-projection inside the layer, no MLP
    "gla": ("residual", "swiglu", 2.667, False),  # flash-linear-attention's models: SwiGLU, 4H x 2/3
    "linear_attention": ("residual", "swiglu", 2.667, False),
    "deltanet": ("residual", "swiglu", 2.667, False),
    "gated_deltanet": ("residual", "swiglu", 2.667, False),
    "deltaproduct": ("residual", "swiglu", 2.667, False),  # fla's GatedDeltaProduct model
    "rglru": ("residual", "geglu", 3, False),  # Griffin: gated GELU MLP, expansion 3
    "slstm": ("residual", "geglu", 1.333, False),  # xLSTM's sLSTM block: GELU-gated, 4/3
    "lru": ("residual", "geglu", 2, False),
    "mingru": ("residual", "geglu", 2, False),
    "minlstm": ("residual", "geglu", 2, False),
    "rnn": ("plain", None, None, None),
    "lstm": ("plain", None, None, None),
    "gru": ("plain", None, None, None),
    "rwkv7": ("residual", "rwkv", 4, False),  # RWKV-7's block: token-shifted relu^2 channel mix, 4H (fla's RWKV7FeedForward)
}


def test_every_cell_declares_its_block():
    assert set(PAPER_BLOCKS) == {n for n in cell_names() if CELLS[n].__module__.startswith("rnnlab.")}  # not tests' own
    for cell, (block, mlp, expand, bias) in PAPER_BLOCKS.items():
        m = compose_config([f"model={cell}"]).model
        assert m.block == block, cell
        if mlp is not None:
            assert m.mlp == mlp, cell
        if expand is not None:
            assert (m.mlp_expand, m.mlp_bias) == (expand, bias), cell


def test_a_model_config_without_the_mlp_keys_gets_the_gated_mlp():
    from rnnlab.config import from_dict, to_dict

    values = to_dict(compose_config(["model=lru"]))
    for key in ("mlp", "mlp_expand", "mlp_bias"):
        del values["model"][key]
    m = from_dict(values).model
    assert (m.mlp, m.mlp_expand, m.mlp_bias) == ("geglu", 2.0, False)


@pytest.mark.parametrize("overrides, message", [
    (["model=attention", "model.mlp=relu"], r"^key 'model.mlp': got 'relu', allowed: none, gelu, geglu, swiglu, rwkv$"),
    (["model=attention", "model.mlp_expand=0"], r"^key 'model.mlp_expand': got 0.0, must be in \(0, 64\]"),
    (["model=attention", "model.mlp_expand=1e9"], r"^key 'model.mlp_expand': got 1000000000.0, must be in"),
    (["model=attention", "model.mlp_expand=nan"], r"^key 'model.mlp_expand': got nan, expected a finite number"),
    (["model=attention", "model.mlp_bias=2"], r"^key 'model.mlp_bias': got 2, expected true or false"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_mamba_is_built_as_the_reference_builds_it():
    """state-spaces/mamba `mamba_simple.py`: the norm before the mixer and no MLP; no bias on in_proj or
    out_proj, the conv's bias; in_proj, x_proj, out_proj and the conv as PyTorch's defaults
    (U(+-fan_in^-1/2)); dt_proj's weight U(+-dt_rank^-1/2) and bias softplus^-1(dt), dt log-uniform in
    [1e-3, 1e-1]; A = -(1..N) per channel through A_log; D = 1."""
    H, N, E, K = 64, 16, 2, 4
    config = compose_config(["model=mamba", f"hidden_dim={H}", "num_layers=2"]).model
    model = build_model(config, output_dim=8, platform="cpu", input_dim=16)
    params = f64(jax.jit(model.init)(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"])
    D, R = E * H, math.ceil(H / 16)
    for layer in (params["stack"]["layer_0"], jax.tree_util.tree_map(lambda a: a[0], params["stack"]["layers"])):
        assert set(layer) == {"norm_0", "recurrence"}  # pre-norm, mixer, residual: no MLP
        np.testing.assert_array_equal(layer["norm_0"]["scale"], np.ones(H))
        mixer, cell = layer["recurrence"], layer["recurrence"]["cell"]
        assert set(mixer) == {"W_xh", "cell"}  # in_proj without a bias
        assert set(cell) == {"conv_w", "conv_b", "W_x", "W_dt", "dt_bias", "A_log", "D", "W_out"}  # out_proj: no bias
        for name, leaf, fan_in in [("in_proj", mixer["W_xh"], H), ("conv_w", cell["conv_w"], K),
                                   ("conv_b", cell["conv_b"], K), ("x_proj", cell["W_x"], D), ("out_proj", cell["W_out"], D),
                                   ("dt_proj", cell["W_dt"], R)]:
            bound = fan_in ** -0.5
            assert np.abs(leaf).max() <= bound, name
            # uniform in +-bound: its standard deviation bound / sqrt(3), to 10% over these many draws
            assert abs(leaf.std() / (bound / np.sqrt(3)) - 1) < 0.1, name
        assert mixer["W_xh"].shape == (H, 2 * D) and cell["W_x"].shape == (D, R + 2 * N)
        np.testing.assert_allclose(cell["A_log"], np.log(np.broadcast_to(np.arange(1, N + 1), (D, N))), rtol=1e-6)
        np.testing.assert_array_equal(cell["D"], np.ones(D))
        dt = np.log1p(np.exp(cell["dt_bias"]))  # softplus(dt_bias)
        assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 1e-1 * (1 + 1e-5)
        # log-uniform: log dt uniform on [log 1e-3, log 1e-1], mean -4.605 and sd 2 ln 10 / sqrt(12) = 1.329
        assert abs(np.log(dt).mean() - math.log(1e-2)) < 0.25 and abs(np.log(dt).std() - 1.329) < 0.15
