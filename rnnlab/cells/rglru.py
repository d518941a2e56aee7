"""RG-LRU, the Real-Gated Linear Recurrent Unit of Griffin (De et al. 2024). State h: [B, H]; u_t: [B, 2H].

    [u_a, u_x] = u_t = x_t W_xh + b;   r_t = sigma(u_a);   i_t = sigma(u_x)
    log a_t = -c * r_t * softplus(Lambda)      (c = 8, Lambda: f32[H])
    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)

x_t is the layer's own input (width H), so layer 0 applies the input projection before it
rather than folding it. Lambda starts where a^c = exp(-c softplus(Lambda)) is uniform in
[0.9, 0.999], the paper's initialisation. Griffin's recurrent block also has a linear map and a
short convolution before the RG-LRU, and a GeLU branch beside it; here the RG-LRU is the layer,
and `model.block=residual` supplies the norm, residual and gated MLP around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab.cells.registry import LinearCell, register_cell

C = 8.0


def _lambda_init(key, shape, dtype=jnp.float32):
    a_c = jax.random.uniform(key, shape, dtype, minval=0.9, maxval=0.999)  # a^c
    return jnp.log(jnp.expm1(-jnp.log(a_c) / C))  # softplus(Lambda) = -log(a^c) / c


@register_cell
class RGLRU(LinearCell):
    name = "rglru"
    num_gates = 2
    uses_layer_input = True

    def param_specs(self):
        return {"Lambda": ((self.hidden_dim,), _lambda_init)}

    def coefficients(self, params, u, x):
        u_a, u_x = jnp.split(u, 2, axis=-1)
        log_a = -C * jax.nn.sigmoid(u_a) * jax.nn.softplus(params["Lambda"])
        multiplier = jnp.sqrt(-jnp.expm1(2 * log_a))  # sqrt(1 - a^2), accurate for a near 1
        return jnp.exp(log_a), multiplier * (jax.nn.sigmoid(u_x) * x)
