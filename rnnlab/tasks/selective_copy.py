"""Selective copying (Gu & Dao 2023, "Mamba", sec. 4.1.1)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rnnlab.options import allowed
from rnnlab.tasks.registry import IGNORE, Task, masked_cross_entropy, per_position_uniform, register_task


@register_task
@dataclasses.dataclass(frozen=True)
class SelectiveCopyTask(Task):
    """Symbols 0 .. V-1 are data (V = `vocab_size`), V is noise, V+1 the delimiter. Input
    (token ids of V+2 symbols): `seq_len` steps of noise holding `num_tokens` (K) random data symbols
    at random distinct positions, the delimiter, then K noise steps (T+1+K steps). Target: the K
    data symbols, in the order they appeared, at the K steps after the delimiter (IGNORE elsewhere).
    Unlike the copy task the data positions vary, so a model must select by content, not by time.

    Loss: cross-entropy over the K recalled steps only (the noise steps are not scored, so the
    loss is not diluted by a long easy stretch); metric: accuracy on them. Baseline ln V: a model
    that does not remember the data symbols can only guess each one uniformly.

    The paper's setting is seq_len 4096, num_tokens 16, vocab_size 16. The defaults here (32, 4,
    8: conf/data/selective_copy.yaml) keep the selection problem and make it small enough for a
    64-unit model on 2 CPU cores: 4 symbols of 3 bits in a 37-step sequence. With
    `data.min_seq_len` an example of length L has its delimiter at step L and padding (`padding_id`)
    after its last recall step.
    """

    num_tokens: int = allowed(4, low=1)  # K: data symbols to recall
    vocab_size: int = allowed(8, low=2)  # V: data symbols

    name = "selective_copy"
    token_inputs = True

    @property
    def input_dim(self) -> int:
        return self.vocab_size + 2  # data symbols, noise, delimiter

    @property
    def output_dim(self) -> int:
        return self.vocab_size

    @property
    def noise(self) -> int:
        return self.vocab_size

    @property
    def delimiter(self) -> int:
        return self.vocab_size + 1

    @property
    def min_seq_len(self) -> int:
        return self.num_tokens  # room for K distinct positions

    @property
    def total_len(self) -> int:
        return self.seq_len + 1 + self.num_tokens

    @property
    def baseline_loss(self) -> float:
        return math.log(self.vocab_size)

    def sample_padded(self, key, length):
        """-> (inputs int32[T+1+K] token ids, padding after step length+K; targets int32[T+1+K])."""
        k_symbols, k_positions = jax.random.split(key)
        symbols = jax.random.randint(k_symbols, (self.num_tokens,), 0, self.vocab_size)
        # K distinct positions in [0, length), uniformly: the K smallest of per-position uniforms.
        scores = jnp.where(jnp.arange(self.seq_len) < length, per_position_uniform(k_positions, self.seq_len), 2.0)
        positions = jnp.sort(jnp.argsort(scores)[: self.num_tokens])
        tokens = jnp.full((self.total_len,), self.noise).at[positions].set(symbols).at[length].set(self.delimiter)
        valid = jnp.arange(self.total_len) <= length + self.num_tokens
        recall = length + 1 + jnp.arange(self.num_tokens)
        targets = jnp.full((self.total_len,), IGNORE).at[recall].set(symbols)
        return jnp.where(valid, tokens, self.padding_id).astype(jnp.int32), targets

    def symbol_names(self):
        return {self.noise: "_", self.delimiter: ">"}

    def loss_and_metrics(self, outputs, targets):
        """outputs: f32[B, T+1+K, V] logits, targets: int32[B, T+1+K] -> (cross-entropy over the
        recalled steps, {accuracy on them})."""
        loss, accuracy = masked_cross_entropy(outputs, targets)
        return loss, {"accuracy": accuracy}
