"""minLSTM (Feng et al. 2024, "Were RNNs All We Needed?"). State h: [B, H]; u_t: [B, 3H], gates from x_t only.

    [u_f, u_i, u_h] = u_t;   f_t = sigma(u_f);   i_t = sigma(u_i);   h~_t = u_h
    f'_t = f_t / (f_t + i_t);   i'_t = i_t / (f_t + i_t)
    h_t = f'_t * h_{t-1} + i'_t * h~_t

The forget block's bias starts at `model.forget_bias`, as the LSTM's does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rnnlab.cells.registry import LinearCell, register_cell


@register_cell
class MinLSTM(LinearCell):
    name = "minlstm"
    num_gates = 3

    def bias_init(self):
        def init(key, shape, dtype=jnp.float32):
            del key
            h = shape[0] // self.num_gates
            return jnp.zeros(shape, dtype).at[:h].set(self.forget_bias)

        return init

    def coefficients(self, params, u, x):
        u_f, u_i, u_h = jnp.split(u, 3, axis=-1)
        f, i = jax.nn.sigmoid(u_f), jax.nn.sigmoid(u_i)
        total = f + i
        return f / total, (i / total) * u_h
