"""minGRU (Feng et al. 2024, "Were RNNs All We Needed?"). State h: [B, H]; u_t: [B, 2H], gates from x_t only.

    [u_z, u_h] = u_t = x_t W_xh + b;   z_t = sigma(u_z);   h~_t = u_h
    h_t = (1 - z_t) * h_{t-1} + z_t * h~_t          (a_t = 1 - z_t, b_t = z_t * h~_t)

No matmul inside the recurrence: the time scan is elementwise and can run associatively.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab.cells.registry import LinearCell, register_cell


@register_cell
class MinGRU(LinearCell):
    name = "mingru"
    num_gates = 2

    def coefficients(self, params, u, x):
        u_z, u_h = jnp.split(u, 2, axis=-1)
        z = jax.nn.sigmoid(u_z)
        return 1 - z, z * u_h
