"""RWKV-7 "Goose" time mixing (Peng et al. 2025, "RWKV-7 Goose with Expressive Dynamic State Evolution"),
as flash-linear-attention's `RWKV7Attention` computes it (`fla/layers/rwkv7.py`). Per layer, from the layer
input x_t: [H] (time-major, x_{-1} = 0), with heads of d = H / num_heads channels and per-head state
S: [d, d] in the row convention of `rnnlab.cells.dplr_forms`:

    x*_t = x_t + (x_{t-1} - x_t) * mu_*              token shift, one lerp mu_* [H] each for * = r, w, k, v, a, g
    r = x^r W_r,  k = x^k W_k,  v = x^v W_v          (no biases)
    log w = -exp(-1/2) sigmoid(tanh(x^w W_w1) W_w2 + w_0)      decay w in (exp(-exp(-1/2)), 1), per channel
    a = sigmoid(x^a W_a1 W_a2 + a_0)                 in-context learning rate, per channel
    g = sigmoid(x^g W_g1) W_g2                       output gate (a LoRA with a sigmoid inside)
    kappa = L2-normalise(k * k_k) per head;          k <- k * (1 + (a - 1) * k_a)
    S_t = (diag(w_t) - (kappa_t * a_t)^T kappa_t) S_{t-1} + k_t^T v_t,      o_t = r_t S_t
    y = ((GroupNorm(o) + (sum_head(r * k * r_k)) v) * g) W_o       GroupNorm per head, eps d * 1e-5, affine

`model.allow_neg_eigval=true` is the extended RWKV-7 of RWKV-Othello (its README's two-line change to RWKV-LM,
provided by BlinkDL), Grazzi et al.'s switch (ICLR 2025) for this transition: a = 2 sigmoid(.) in (0, 2), and the
removal scaled by the decay, so that the transition is the product diag(w) (I - (kappa * a)^T kappa), gated
DeltaNet's and KDA's shape, with eigenvalues in (-1, 1] (checked numerically over random w, a, kappa): the
reflection parity needs. Without the switch its least eigenvalue is exp(-exp(-1/2)) - 1 = -0.455. The doubled a also
scales the replacement key (k <- k (1 + (a - 1) k_a)), as there.

The transition is diagonal plus rank one, so there is no cheap associative form: `sequential` runs it one
step at a time (`dplr_recurrent`), `chunked` is the chunkwise WY form (`dplr_chunked`). Both carry a state
(`initial_state`): S per head and the token shift's last input.

The cell reads the layer input itself (the token shift needs x), so its input term is empty (`input_width`
0): all its projections are its own parameters. Left out: RWKV-7's value residual (v lerped towards the
first layer's v by a fourth LoRA), which needs a value carried across layers. Initialisation: fla's
`_initialize_weights` for layer 0 (a cell does not know its depth), the GroupNorm weight 1.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rnnlab import fused
from rnnlab.cells.common import shift_in
from rnnlab.cells.dplr_forms import dplr_chunked, dplr_flops, dplr_recompute_flops, dplr_recurrent
from rnnlab.cells.registry import SequenceCell, register_cell, shift_back
from rnnlab.options import allowed

LOG_W_MIN = -math.exp(-0.5)  # the least log-decay: w >= exp(-exp(-1/2)) ~ 0.545
NORM_EPS = 1e-5  # times the head width: fla's GroupNorm eps
LERPS = {"x_r": 0.2, "x_w": 0.9, "x_k": 0.7, "x_v": 0.7, "x_a": 0.9, "x_g": 0.2}  # mu_* = 1 - (n / H)^exponent


def constant(values: np.ndarray):
    """An initializer that returns `values` (whatever the key)."""
    def init(key, shape, dtype=jnp.float32):
        del key
        return jnp.broadcast_to(jnp.asarray(values, dtype), shape)

    return init


def orthogonal(gain: float):
    """torch's `orthogonal_(W, gain)` of the [fan_out, fan_in] weight, transposed to our [fan_in, fan_out]."""
    return nn.initializers.orthogonal(scale=gain)


@register_cell
@dataclasses.dataclass(frozen=True)
class RWKV7(SequenceCell):
    num_heads: int = allowed(4, divides="hidden_dim")  # heads; head width H / num_heads (RWKV fixes 64)
    chunk_size: int = allowed(16, low=1)  # steps per chunk (chunked) and per checkpointed block (sequential); fla's 16
    # rank of the decay LoRA; 0: round(2.5 sqrt(H)) (fla's formula, without its floor of 32)
    decay_rank: int = allowed(0, low=0, note="0 = from hidden_dim")
    # rank of the in-context learning rate's LoRA; 0: round(2.5 sqrt(H))
    iclr_rank: int = allowed(0, low=0, note="0 = from hidden_dim")
    # rank of the output gate's LoRA; 0: round(5 sqrt(H))
    gate_rank: int = allowed(0, low=0, note="0 = from hidden_dim")
    allow_neg_eigval: bool = False  # a in (0, 2) and the removal times w: eigenvalues in (-1, 1] (Grazzi et al.)

    name = "rwkv7"
    time_scans = ("sequential", "chunked", "fused")  # fused: `rnnlab.fused.dplr`, CPU
    # model.time_scan=auto: on a CPU where the kernel builds, fused (`rnnlab.models.build_model`); elsewhere
    # sequential up to T=64, the chunked form beyond (measured: docs/benchmarks.md,
    # "Forms by length")
    default_time_scan = "auto"
    auto_forms = ((64, "sequential"),)
    long_form = "chunked"
    uses_layer_input = True
    input_bias = False

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def input_width(self) -> int:
        return 0  # every projection reads a different token-shifted x: the cell owns them

    def ranks(self) -> tuple[int, int, int]:
        """(decay, iclr, gate) LoRA ranks, the zeros resolved."""
        root = math.sqrt(self.hidden_dim)
        auto = (max(1, round(2.5 * root)), max(1, round(2.5 * root)), max(1, round(5 * root)))
        return tuple(r or a for r, a in zip((self.decay_rank, self.iclr_rank, self.gate_rank), auto))

    def state_floats(self, seq_len):
        # S per head; like the other cells' short convolutions, the token shift's x_{t-1} is not counted
        return self.num_heads * self.head_dim * self.head_dim

    def input_init(self):
        return nn.initializers.zeros_init()

    def param_specs(self):
        """fla's `_initialize_weights` for layer 0 of the model (ratio_0_to_1 = 0, ratio_1_to_almost0 = 1)."""
        h, d, heads = self.hidden_dim, self.head_dim, self.num_heads
        n = np.arange(h)
        ddd = n / h
        linear = n / max(h - 1, 1) - 0.5
        zigzag = ((n % d) - (d - 1) / 2) / ((d - 1) / 2) if d > 1 else np.zeros(h)
        zigzag = zigzag * np.abs(zigzag)
        www = -6 + 6 * (n / max(h - 1, 1))
        decay, iclr, gate = self.ranks()

        def lora_out(rank):  # LoRA's second map: orthogonal, gain 0.1 (x sqrt(rank / H) when rank > H)
            return orthogonal(0.1 * (math.sqrt(rank / h) if rank > h else 1.0))

        zeros = nn.initializers.zeros_init()
        specs = {name: ((h,), constant(1 - ddd**e)) for name, e in LERPS.items()}
        return specs | {
            "W_r": ((h, h), orthogonal(1.0)), "W_k": ((h, h), orthogonal(0.1)), "W_v": ((h, h), orthogonal(1.0)),
            "W_o": ((h, h), zeros),
            "w_1": ((h, decay), zeros), "w_2": ((decay, h), lora_out(decay)),
            "w_0": ((h,), constant(www + 0.5 + 2.5 * zigzag)),
            "a_1": ((h, iclr), zeros), "a_2": ((iclr, h), lora_out(iclr)),
            "a_0": ((h,), constant(-0.19 + 0.3 * zigzag + 0.4 * linear)),
            "g_1": ((h, gate), zeros), "g_2": ((gate, h), lora_out(gate)),
            "k_k": ((h,), constant(0.71 - 0.1 * linear)), "k_a": ((h,), constant(np.full(h, 1.02))),
            "r_k": ((heads, d), constant(np.full((heads, d), -0.04))),
            "norm": ((h,), nn.initializers.ones_init()), "norm_bias": ((h,), zeros),
        }

    def split_heads(self, y: jax.Array) -> jax.Array:
        """[T, B, H] -> [T, B, heads, d]."""
        return y.reshape(*y.shape[:2], self.num_heads, self.head_dim)

    def initial_state(self, batch, dtype, cache_len=0):
        """{S: [B, heads, d, d] float32, x: the token shift's last input x_{t-1} [B, H] in `dtype`}, zeros."""
        return {"S": jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32),
                "x": jnp.zeros((batch, self.hidden_dim), dtype)}

    def mix_state(self, params, u, x, time_scan, unroll, recurrence, state):
        p = params
        f32 = jnp.float32
        delta = (shift_back(x) if state is None else shift_in(x, state["x"])) - x
        lerp = {name: x + delta * p[name] for name in LERPS}
        r, k, v = (lerp[f"x_{c}"] @ p[f"W_{c}"] for c in "rkv")
        log_w = LOG_W_MIN * jax.nn.sigmoid((jnp.tanh(lerp["x_w"] @ p["w_1"]) @ p["w_2"] + p["w_0"]).astype(f32))
        a = jax.nn.sigmoid(((lerp["x_a"] @ p["a_1"]) @ p["a_2"] + p["a_0"]).astype(f32))
        if self.allow_neg_eigval:
            a = 2 * a
        g = jax.nn.sigmoid(lerp["x_g"] @ p["g_1"]) @ p["g_2"]
        kk = self.split_heads((k * p["k_k"]).astype(f32))
        # F.normalize's max(|kk|, 1e-12), as sqrt(max(|kk|^2, 1e-24)): finite gradients where kk = 0 (padding)
        kk = kk * jax.lax.rsqrt(jnp.maximum(jnp.sum(kk * kk, axis=-1, keepdims=True), 1e-24))
        k = (k * (1 + (a - 1) * p["k_a"])).astype(x.dtype)
        r, k, v, a, log_w = (self.split_heads(y) for y in (r, k, v, a, log_w))
        removal = kk * a * jnp.exp(log_w) if self.allow_neg_eigval else kk * a  # diag(w) (I - (kk a)^T kk)
        carried = None if state is None else state["S"]
        if time_scan == "chunked":
            o = dplr_chunked(r, k, v, -kk, removal, log_w, min(self.chunk_size, x.shape[0]), state=carried)
        elif time_scan == "fused":
            o = fused.dplr(r, k, v, -kk, removal, log_w, state=carried)
        else:
            o = dplr_recurrent(r, k, v, -kk, removal, log_w, self.chunk_size, state=carried)
        after = None
        if state is not None:
            o, s = o
            after = {"S": s, "x": x[-1]}
        o32 = o.astype(f32)
        mean = jnp.mean(o32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(o32 - mean), axis=-1, keepdims=True)
        o = ((o32 - mean) * jax.lax.rsqrt(var + self.head_dim * NORM_EPS)).reshape(*x.shape[:2], self.hidden_dim)
        o = o * p["norm"] + p["norm_bias"]
        bonus = jnp.sum((r * k * p["r_k"]).astype(f32), axis=-1, keepdims=True) * v
        o = (o + bonus.reshape(o.shape)) * g
        return o.astype(x.dtype) @ p["W_o"], after

    def mixing_flops(self, seq_len, time_scan):
        h, d = self.hidden_dim, self.head_dim
        projections = 2 * h * h * 4 + 2 * 2 * h * sum(self.ranks())  # r, k, v, o; each LoRA's two maps
        return projections * seq_len + dplr_flops(seq_len, self.num_heads, d, d, time_scan, self.chunk_size)

    def mixing_recompute_flops(self, seq_len, time_scan):
        return dplr_recompute_flops(seq_len, self.num_heads, self.head_dim, self.head_dim, time_scan, self.chunk_size)
