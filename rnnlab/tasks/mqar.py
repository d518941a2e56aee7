"""Multi-query associative recall (Arora et al. 2023, "Zoology"; after zoology/data/multiquery_ar.py)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab.options import allowed
from rnnlab.tasks.registry import IGNORE, OptionError, Task, masked_cross_entropy, per_position_uniform, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class MQARTask(Task):
    """Tokens 0 .. V/2-1 are keys, V/2 .. V-1 values (V = `vocab_size`), V a blank. Input (token ids
    of V+1 symbols) of T = `seq_len` steps: `num_pairs` (P) key-value pairs `k1 v1 k2 v2 ...` (distinct
    keys, distinct values), then blanks in which each key appears once more as a query, in random
    order, at the even offsets after the pairs. Target: at each query, the value paired with that key
    (as a vocabulary token, so the output is V wide); IGNORE elsewhere.

    As in Zoology's generator, the query slots are drawn without replacement with probability
    proportional to (slot + 1)^(power_a - 1) (its default power_a = 0.01 puts queries mostly soon
    after the pairs; 1 is uniform); unlike its default, the filler is a blank token rather than
    random tokens (its `random_non_queries=False`), which keeps a small vocabulary unambiguous.

    Loss: cross-entropy at the P query steps only; metric: accuracy there. Baseline ln(V/2): a
    model that does not remember the pairs sees a key but no value, and every value is equally
    likely. With `data.min_seq_len` an example of length L has its queries in [2P, L) and padding
    (`padding_id`) from step L on.
    """

    vocab_size: int = 32  # V: keys and values, half each
    num_pairs: int = allowed(4, low=1)  # P: key-value pairs, each queried once
    # query slot distribution, as Zoology's power_a (1: uniform)
    power_a: float = allowed(0.01, low=0.0, low_open=True, high=1.0)

    name = "mqar"
    token_inputs = True

    @property
    def input_dim(self) -> int:
        return self.vocab_size + 1  # keys, values, blank

    @property
    def output_dim(self) -> int:
        return self.vocab_size

    @property
    def min_seq_len(self) -> int:
        return 4 * self.num_pairs  # 2P steps of pairs, then P query slots of 2 steps each

    @property
    def baseline_loss(self) -> float:
        return math.log(self.vocab_size // 2)

    def check(self) -> None:
        super().check()
        if self.vocab_size % 2 or self.vocab_size < 2 * self.num_pairs:
            raise OptionError(f"key 'data.vocab_size': got {self.vocab_size}, must be even and >= 2 x "
                              f"data.num_pairs = {2 * self.num_pairs} (distinct keys and values, half each)")

    def sample_padded(self, key, length):
        """-> (inputs int32[T] token ids, padding from step `length` on; targets int32[T])."""
        k_keys, k_values, k_slots = jax.random.split(key, 3)
        half, pairs = self.vocab_size // 2, self.num_pairs
        keys = jax.random.choice(k_keys, half, (pairs,), replace=False)
        values = half + jax.random.choice(k_values, half, (pairs,), replace=False)
        # Query slots without replacement, weighted: the P largest log-weight + Gumbel noise.
        slot = jnp.arange((self.seq_len - 2 * pairs) // 2)
        gumbel = -jnp.log(-jnp.log(per_position_uniform(k_slots, slot.size) + 1e-20) + 1e-20)
        score = jnp.where(2 * (pairs + slot) + 1 < length + 1, (self.power_a - 1) * jnp.log1p(slot) + gumbel, -jnp.inf)
        queries = 2 * pairs + 2 * jnp.argsort(-score)[:pairs]  # query i asks for key i
        steps = jnp.arange(self.seq_len)
        context = jnp.stack([keys, values], axis=1).reshape(-1)
        tokens = jnp.full((self.seq_len,), self.vocab_size).at[: 2 * pairs].set(context).at[queries].set(keys)
        targets = jnp.full((self.seq_len,), IGNORE).at[queries].set(values)
        return jnp.where(steps < length, tokens, self.padding_id).astype(jnp.int32), targets

    def symbol_names(self):
        return {self.vocab_size: "_"}

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T, V] logits, targets: int32[B, T] -> (cross-entropy at the queries, {accuracy there})."""
        loss, accuracy = masked_cross_entropy(outputs, targets)
        return loss, {"accuracy": accuracy}
