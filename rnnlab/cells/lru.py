"""LRU, the Linear Recurrent Unit (Orvieto et al. 2023, "Resurrecting Recurrent Neural Networks for
Long Sequences"). Complex state h: [B, H]; u_t: [B, 2H] holds Re and Im of x_t B.

    lambda = exp(-exp(nu) + i exp(theta))                    (nu, theta: f32[H]; |lambda| < 1)
    h_t = lambda * h_{t-1} + gamma * (x_t B),   gamma = sqrt(1 - |lambda|^2)
    y_t = Re(h_t C) + D * x_t                                (C: complex [H, H], D: f32[H])

lambda is initialised uniformly on the ring r_min <= |lambda| <= r_max with phase in
[0, max_phase] (`model.r_min`, `model.r_max`, `model.max_phase`); B and C with variance
1/(2 fan_in) per real part, as in the paper. The transition does not depend on the input
(the LRU is time-invariant), and the recurrence runs in complex64 whatever `model.dtype`.
x_t is the layer's own input (width H, for D * x_t), so layer 0 applies the input projection
before it rather than folding it.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rnnlab.cells.registry import LinearCell, register_cell
from rnnlab.options import allowed


@register_cell
@dataclasses.dataclass(frozen=True)
class LRU(LinearCell):
    r_min: float = 0.0  # smallest initial |lambda|
    r_max: float = 0.99  # largest initial |lambda| (the paper uses 0.9 .. 0.999 for long sequences)
    max_phase: float = allowed(2 * math.pi, low=0, low_open=True)  # initial phases lie in [0, max_phase]

    name = "lru"
    num_gates = 2
    uses_layer_input = True

    def param_specs(self):
        h = self.hidden_dim

        def nu_init(key, shape, dtype=jnp.float32):
            u = jax.random.uniform(key, shape, dtype)
            return jnp.log(-0.5 * jnp.log(u * (self.r_max**2 - self.r_min**2) + self.r_min**2))

        def theta_init(key, shape, dtype=jnp.float32):
            return jnp.log(self.max_phase * jax.random.uniform(key, shape, dtype, minval=1e-6))

        c_init = nn.initializers.normal(1 / math.sqrt(2 * h))
        return {"nu": ((h,), nu_init), "theta": ((h,), theta_init), "C_re": ((h, h), c_init),
                "C_im": ((h, h), c_init), "D": ((h,), nn.initializers.normal(1.0))}

    def option_problem(self):
        if not 0.0 <= self.r_min < self.r_max < 1.0:
            return (f"keys 'model.r_min', 'model.r_max': got {self.r_min}, {self.r_max}; "
                    f"allowed: 0 <= r_min < r_max < 1 (|lambda| < 1 keeps the recurrence stable)")
        return super().option_problem()

    def input_init(self):
        return nn.initializers.variance_scaling(0.5, "fan_in", "normal")

    def eigenvalues(self, params) -> jax.Array:
        """lambda: complex64[H]."""
        nu, theta = params["nu"].astype(jnp.float32), params["theta"].astype(jnp.float32)
        return jnp.exp(-jnp.exp(nu) + 1j * jnp.exp(theta))

    def coefficients(self, params, u, x):
        lam = self.eigenvalues(params)
        gamma = jnp.sqrt(1 - jnp.abs(lam) ** 2)
        u_re, u_im = jnp.split(u.astype(jnp.float32), 2, axis=-1)
        b = gamma * jax.lax.complex(u_re, u_im)
        return jnp.broadcast_to(lam, b.shape), b

    def output(self, params, hs, x):
        dtype = x.dtype
        y = jnp.real(hs).astype(dtype) @ params["C_re"] - jnp.imag(hs).astype(dtype) @ params["C_im"]
        return y + params["D"] * x

    def state_dtype(self, dtype):
        return jnp.complex64  # h is complex, its coefficients in float32 whatever model.dtype

    def state_floats(self, seq_len):
        return 2 * self.hidden_dim  # complex

    def mixing_flops(self, seq_len, time_scan):
        return 2 * 2 * self.hidden_dim * self.hidden_dim * seq_len  # Re(h C) as two real [H, H] matmuls
