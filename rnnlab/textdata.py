"""Character-level language modelling data (`data=text`): the splits of a corpus into training and held-out
documents, the layout of a text into contiguous streams for truncated backpropagation through time, and
bits per character.

Bytes are the tokens (256 of them). The training text is the training documents concatenated in corpus
order; the held-out texts (validation, test) are their documents concatenated in the config's order.

Windows (`window_starts`): every document is cut into windows of T = `seq_len` inputs, each window's
targets the bytes one further on, a document's last window padded (input `padding_id`, target IGNORE) so
that no window crosses a document's end: each document starts at a window's first position. A document
of n bytes holds n - 1 predictions (its first byte is predicted by nothing: the state resets before it),
in ceil((n - 1) / T) windows; a split of D documents and N bytes, N - D predictions.

Training (`StreamLayout`): the training text's C windows, in order, cut into B = `batch_size` contiguous
streams of L = C // B windows (the last C mod B windows unused); an epoch is S = L steps, and step k
(j = k mod S) takes window b L + j of every stream b, so that the model's state at the end of step k
belongs before step k + 1's first byte. The state is reset only at a window's first position: where a
document starts, and at the first step of an epoch (each stream starts afresh); `reset` marks those
(with `carry_state=False`, every step's first position). A reset is so one flag per row at a step's start.

Evaluation (`EvalLayout`): a held-out text's C windows cut into E = `num_streams` contiguous streams of
P = ceil(C / E) windows, each stream run from a fresh state, window k of every stream its segment k
(a stream past the last window: every target IGNORE). Every prediction of the text is scored exactly
once. `carry_state=False` marks a reset at every segment's start (the `bpc_reset` evaluation: the state
never older than T bytes).

The layouts are pure functions of the step (or segment) and the rows asked for, written with jax.numpy: a
resumed run needs no loader state, and a device takes only its own rows of the batch (`rows`, the global
indices of its rows) from the text held on it (`TextArrays`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

VOCAB_SIZE = 256  # bytes
IGNORE = -1  # a target that is not scored (as `rnnlab.tasks.IGNORE`)


class SplitError(ValueError):
    """The held-out documents name no document of the corpus, or overlap: one line naming the key."""


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """One split on the host: its documents' bytes concatenated (`text`, uint8[N]), document i starting at
    `starts[i]` (int64[D], increasing, the first 0) and named `names[i]`."""

    names: tuple[str, ...]
    text: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.text)

    def document(self, name: str) -> bytes:
        i = self.names.index(name)
        end = self.starts[i + 1] if i + 1 < len(self.names) else len(self.text)
        return self.text[self.starts[i]:end].tobytes()

    def arrays(self, seq_len: int) -> "TextArrays":
        """The split as device arrays (`TextArrays`) cut in windows of `seq_len`: what the layouts read."""
        return TextArrays(jnp.asarray(self.text, jnp.uint8), jnp.asarray(self.starts, jnp.int32),
                          jnp.asarray(self.window_starts(seq_len), jnp.int32))

    def window_starts(self, seq_len: int) -> np.ndarray:
        """`window_starts` of this split."""
        return window_starts(self.starts, len(self.text), seq_len)


def concatenate(documents: Mapping[str, bytes], names: Sequence[str]) -> Split:
    """The documents `names` of `documents`, in that order, as one `Split`."""
    parts = [np.frombuffer(documents[n], np.uint8) for n in names]
    sizes = np.array([len(p) for p in parts], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if parts else np.zeros(0, np.int64)
    text = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    text.flags.writeable = False
    return Split(tuple(names), text, starts)


def split_documents(documents: Mapping[str, bytes], valid_docs: Sequence[str], test_docs: Sequence[str],
                    corpus: str = "the corpus") -> dict[str, Split]:
    """{"train", "valid", "test"}: the held-out documents `valid_docs` and `test_docs` in their given order,
    training every other document in the corpus's order (`documents`' order)."""
    check_held_out(tuple(documents), valid_docs, test_docs, corpus)
    held_out = set(valid_docs) | set(test_docs)
    train = [n for n in documents if n not in held_out]
    return {"train": concatenate(documents, train), "valid": concatenate(documents, valid_docs),
            "test": concatenate(documents, test_docs)}


def check_held_out(names: Sequence[str], valid_docs: Sequence[str], test_docs: Sequence[str],
                   corpus: str = "the corpus") -> None:
    """SplitError unless the held-out documents are documents of the corpus, each held out once, with at
    least one validation document and at least one document left to train on."""
    for key, chosen in (("data.valid_docs", valid_docs), ("data.test_docs", test_docs)):
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise SplitError(f"key '{key}': {unknown[0]!r} is not a document of {corpus} "
                             f"(`python -m rnnlab.corpora list` names them)")
        if len(set(chosen)) < len(chosen):
            raise SplitError(f"key '{key}': got {list(chosen)}, a document twice")
    both = sorted(set(valid_docs) & set(test_docs))
    if both:
        raise SplitError(f"key 'data.test_docs': {both[0]!r} is held out for validation too (data.valid_docs)")
    if not valid_docs:
        raise SplitError("key 'data.valid_docs': got [], allowed: a list of one or more documents to evaluate on")
    if len(set(valid_docs) | set(test_docs)) >= len(set(names)):
        raise SplitError(f"key 'data.valid_docs': every document of {corpus} is held out: none is left to train on")


def window_starts(starts: np.ndarray, length: int, seq_len: int) -> np.ndarray:
    """int64[C]: the first position of every window of `seq_len` inputs, document by document (documents
    starting at `starts`, the text `length` bytes long): a document [s, e) has windows s, s + T, ... before
    e - 1 (a window holds at least one prediction; a one-byte document none)."""
    ends = list(np.asarray(starts[1:]).tolist()) + [length]
    parts = [np.arange(s, e - 1, seq_len, dtype=np.int64) for s, e in zip(np.asarray(starts).tolist(), ends)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class TextArrays:
    """A split on the device: `text` uint8[N], `starts` int32[D] (its documents' first positions, increasing),
    `windows` int32[C] (`window_starts` at the task's seq_len)."""

    text: jax.Array
    starts: jax.Array
    windows: jax.Array


jax.tree_util.register_dataclass(TextArrays, data_fields=["text", "starts", "windows"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class TextWindow:
    """One step's (or segment's) rows: `inputs` int32[R, T] byte ids, `targets` int32[R, T] (the next byte;
    IGNORE where not scored), `reset` bool[R, T] (True at a position the state carried into it does not
    belong to: the model resets its state before reading that position's input)."""

    inputs: jax.Array
    targets: jax.Array
    reset: jax.Array


jax.tree_util.register_dataclass(TextWindow, data_fields=["inputs", "targets", "reset"], meta_fields=[])


def document_starts(starts: jax.Array, positions: jax.Array) -> jax.Array:
    """bool[...]: whether each position of `positions` is the first byte of a document (`starts` increasing)."""
    index = jnp.clip(jnp.searchsorted(starts, positions), 0, starts.shape[0] - 1)
    return starts[index] == positions


def _rows(first_row: jax.Array | int, rows: int) -> jax.Array:
    return jnp.asarray(first_row, jnp.int32) + jnp.arange(rows, dtype=jnp.int32)


def read_windows(arrays: TextArrays, windows: jax.Array, seq_len: int, pad_id: int,
                 valid: jax.Array | bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Windows `windows` (int32[R], indices into `arrays.windows`) -> (inputs int32[R, T], targets int32[R, T],
    whether each window starts a document bool[R]): past its document's last prediction (and in a row not
    `valid`) a window's inputs are `pad_id`, its targets IGNORE."""
    count = arrays.windows.shape[0]
    first = arrays.windows[jnp.clip(windows, 0, count - 1)]
    following = jnp.searchsorted(arrays.starts, first, side="right")  # the next document's index
    end = jnp.where(following < arrays.starts.shape[0],
                    arrays.starts[jnp.clip(following, 0, arrays.starts.shape[0] - 1)], arrays.text.shape[0])
    positions = first[:, None] + jnp.arange(seq_len, dtype=jnp.int32)[None, :]
    scored = (positions + 1 < end[:, None]) & jnp.asarray(valid)[..., None]
    safe = jnp.where(scored, positions, 0)
    inputs = jnp.where(scored, arrays.text[safe].astype(jnp.int32), pad_id)
    targets = jnp.where(scored, arrays.text[safe + 1].astype(jnp.int32), IGNORE)
    return inputs, targets, document_starts(arrays.starts, first)


def _reset_at_first(flags: jax.Array, seq_len: int) -> jax.Array:
    """bool[R] -> bool[R, T]: True at the first position of the rows flagged."""
    return flags[:, None] & (jnp.arange(seq_len) == 0)[None, :]


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """The training text's `num_windows` windows as `num_streams` contiguous streams, a window a step."""

    num_windows: int  # C: windows of the training text (`window_starts`)
    num_streams: int  # B: the global batch
    seq_len: int  # T

    def __post_init__(self):
        if self.num_streams < 1 or self.seq_len < 1:
            raise ValueError(f"num_streams and seq_len must be >= 1, got {self.num_streams}, {self.seq_len}")
        if self.stream_len < 1:
            raise ValueError(f"a training text of {self.num_windows:,} windows of seq_len={self.seq_len} cut into "
                             f"{self.num_streams} streams gives fewer than seq_len bytes to each: a smaller "
                             f"batch_size or seq_len")

    @property
    def stream_len(self) -> int:
        """L = C // B: windows of each stream."""
        return self.num_windows // self.num_streams

    @property
    def steps_per_epoch(self) -> int:
        """S = L: steps before the streams start again."""
        return self.stream_len

    def window_indices(self, step: jax.Array | int, rows: jax.Array) -> jax.Array:
        """int32[R]: the window each of the rows `rows` reads at `step`."""
        within = jnp.asarray(step, jnp.int32) % self.steps_per_epoch
        return rows.astype(jnp.int32) * self.stream_len + within

    def window(self, arrays: TextArrays, step: jax.Array | int, first_row: jax.Array | int, rows: int,
               carry_state: bool = True, pad_id: int = VOCAB_SIZE) -> TextWindow:
        """Step `step`'s rows first_row .. first_row + rows - 1 (of the B streams): inputs, the next bytes as
        targets, and `reset` at a window's first position where a document starts or an epoch does (every
        step's first position without `carry_state`). A function of the step alone: step S + k is step k."""
        inputs, targets, starts = read_windows(arrays, self.window_indices(step, _rows(first_row, rows)),
                                               self.seq_len, pad_id)
        epoch_start = (jnp.asarray(step, jnp.int32) % self.steps_per_epoch) == 0
        fresh = starts | (True if not carry_state else epoch_start)
        return TextWindow(inputs, targets, _reset_at_first(fresh, self.seq_len))


@dataclasses.dataclass(frozen=True)
class EvalLayout:
    """A held-out text's `num_windows` windows as `num_streams` contiguous streams, run a window (a segment)
    at a time; every prediction scored exactly once."""

    num_windows: int  # C
    num_streams: int  # E
    seq_len: int  # T: a segment

    def __post_init__(self):
        if self.num_streams < 1 or self.seq_len < 1:
            raise ValueError(f"num_streams and seq_len must be >= 1, got {self.num_streams}, {self.seq_len}")
        if self.num_windows < 1:
            raise ValueError("a held-out text with nothing to predict")

    @property
    def stream_len(self) -> int:
        """P = ceil(C / E): windows of every stream (the last streams' may be fewer, or none)."""
        return -(-self.num_windows // self.num_streams)

    @property
    def num_segments(self) -> int:
        """P: segments of every stream."""
        return self.stream_len

    def window(self, arrays: TextArrays, segment: jax.Array | int, first_row: jax.Array | int, rows: int,
               carry_state: bool = True, pad_id: int = VOCAB_SIZE) -> TextWindow:
        """Segment `segment` of streams first_row .. first_row + rows - 1: targets IGNORE (inputs `pad_id`)
        past a document's last prediction and past the text's windows; `reset` at the first position of a
        document's window and of a stream (of every segment without `carry_state`)."""
        segment = jnp.asarray(segment, jnp.int32)
        index = _rows(first_row, rows) * self.stream_len + segment
        valid = index < self.num_windows
        inputs, targets, starts = read_windows(arrays, index, self.seq_len, pad_id, valid)
        fresh = starts | (True if not carry_state else segment == 0)
        return TextWindow(inputs, targets, _reset_at_first(valid & fresh, self.seq_len))


def unigram_entropy(data: bytes | np.ndarray) -> float:
    """Bits per byte of the best model that ignores context: the entropy of the bytes' frequencies in `data`."""
    array = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data)
    counts = np.bincount(array.ravel().astype(np.int64), minlength=VOCAB_SIZE).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def bits(nats: float | jax.Array) -> float | jax.Array:
    """Nats -> bits (per character, for a loss per byte): nats / ln 2."""
    return nats / math.log(2)


def nats(bits_: float | jax.Array) -> float | jax.Array:
    return bits_ * math.log(2)


def decode(ids: np.ndarray | Sequence[int]) -> str:
    """Byte ids -> text (UTF-8, undecodable bytes replaced; ids outside 0..255 dropped): for samples and logs."""
    return bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < VOCAB_SIZE).decode("utf-8", "replace")


def encode(text: str) -> np.ndarray:
    """Text -> int32 byte ids (UTF-8): a sampling prompt."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
