"""Character-level language modelling on real text (`data=text`): bytes in, the next byte out, bits per character."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rnnlab import corpora, textdata
from rnnlab.options import allowed
from rnnlab.tasks.registry import IGNORE, OptionError, Task, register_task

# The plays held out by default (conf/data/text.yaml): a tragedy, a comedy and a history each, about 420 KB each
# (8% of the corpus); training has the other 36 documents (4.2 MB).
VALID_DOCS = ("hamlet", "twelfth_night", "richard_ii")
TEST_DOCS = ("othello", "much_ado_about_nothing", "henry_v")


@functools.lru_cache(maxsize=8)
def load_splits(corpus: str, corpus_dir: str | None, valid_docs: tuple[str, ...], test_docs: tuple[str, ...]
                ) -> dict[str, textdata.Split]:
    """{"train", "valid", "test"} of a corpus (host arrays), read, checked and split once per process.
    Raises corpora.CorpusError (one line) for a corpus that cannot be had."""
    documents = corpora.load_documents(corpus, corpus_dir)
    try:
        return textdata.split_documents(documents.as_dict(), valid_docs, test_docs, f"corpus {corpus!r}")
    except textdata.SplitError as e:
        raise corpora.CorpusError(str(e)) from None


@register_task
@dataclasses.dataclass(frozen=True)
class TextTask(Task):
    """Input int32[T]: T = `seq_len` bytes of the corpus `data.corpus` as token ids; target int32[T]: the
    byte after each. Loss: cross-entropy in nats, averaged over every position; metric `bpc` (bits per
    character: the loss / ln 2). Baseline: the unigram entropy of the training text, in nats (the best
    model that ignores context).

    The documents `data.valid_docs` and `data.test_docs` are held out whole; training reads the others
    (rnnlab.textdata). Training is truncated backpropagation through time over `batch_size` contiguous
    streams (`sample_step`: a function of the step); the state carried from step to step, reset where
    `TextWindow.reset` says (a document's start, an epoch's; every step with `data.carry_state=false`).
    Evaluation runs a held-out text through `data.eval_streams` streams in segments of `seq_len`
    (`eval_window`): `bpc` with the state carried, `bpc_reset` reset at each segment.

    Every document is cut into windows of `seq_len` (its last one padded: input `padding_id`, target
    IGNORE), so a document starts at a window's first position and a reset is one flag per row at a
    step's (segment's) start (`reset[:, 0]`; `reset[:, 1:]` is always False). A document's first byte is
    not predicted (nothing before it in the document).

    Nothing is read when the task is made or checked (the config is checked without I/O; the
    shakespeare corpus's names are constants): the corpus is read at the first use of its bytes
    (`splits`, `baseline_loss`, the samplers), once per process.
    """

    corpus: str = allowed("shakespeare", choices=corpora.corpus_names)
    corpus_dir: Optional[str] = None  # data.corpus=file: the directory of its .txt documents
    valid_docs: tuple[str, ...] = VALID_DOCS
    test_docs: tuple[str, ...] = TEST_DOCS
    carry_state: bool = True  # false: the state reset at every training step (no BPTT across steps)
    eval_streams: int = allowed(64, low=1)  # the held-out text cut into this many streams, each from a fresh state

    name = "text"
    input_dim = textdata.VOCAB_SIZE
    output_dim = textdata.VOCAB_SIZE
    min_seq_len = 1
    token_inputs = True
    eval_options = ("eval_streams",)  # how the held-out text is cut for evaluation: training never reads it

    def check(self) -> None:
        """The declared ranges, then the held-out documents against the corpus's names (no download: a
        fetched corpus's names are constants; `file` lists its directory)."""
        super().check()
        try:
            names = corpora.get_corpus(self.corpus, self.corpus_dir).document_names()
            textdata.check_held_out(names, self.valid_docs, self.test_docs, f"corpus {self.corpus!r}")
        except (corpora.CorpusError, textdata.SplitError) as e:
            raise OptionError(str(e)) from None

    # The data (read at first use).

    @property
    def splits(self) -> dict[str, textdata.Split]:
        """{"train", "valid", "test"} on the host (`load_splits`); raises corpora.CorpusError."""
        return load_splits(self.corpus, self.corpus_dir, tuple(self.valid_docs), tuple(self.test_docs))

    def arrays(self, split: str = "train") -> textdata.TextArrays:
        """A split as device arrays (uint8 text, int32 document starts): what `sample_step` and `eval_window`
        read. Pass them to a jitted function as an argument (a closed-over array is compiled in as a constant)."""
        return self.splits[split].arrays(self.seq_len)

    @property
    def baseline_loss(self) -> float:
        return textdata.nats(textdata.unigram_entropy(self.splits["train"].text))

    # Training: truncated BPTT over contiguous streams.

    def train_layout(self, batch_size: int) -> textdata.StreamLayout:
        """The training text as `batch_size` streams read `seq_len` bytes a step."""
        return textdata.StreamLayout(len(self.splits["train"].window_starts(self.seq_len)), batch_size, self.seq_len)

    def sample_step(self, arrays: textdata.TextArrays, step: jax.Array, first_row: jax.Array, rows: int,
                    batch_size: int) -> textdata.TextWindow:
        """Rows first_row .. first_row + rows - 1 of the global batch (`batch_size` streams) at `step`
        (traced; step S + k is step k of the next epoch): a device's share, drawn on it from `arrays`
        (`arrays("train")`). The state the model ends step k with starts step k + 1; it resets before
        every position `reset` marks."""
        layout = textdata.StreamLayout(arrays.windows.shape[0], batch_size, self.seq_len)
        return layout.window(arrays, step, first_row, rows, self.carry_state, self.padding_id)

    # Evaluation: a held-out text through `eval_streams` streams, segment by segment.

    def eval_layout(self, split: str = "valid") -> textdata.EvalLayout:
        return textdata.EvalLayout(len(self.splits[split].window_starts(self.seq_len)), self.eval_streams, self.seq_len)

    def eval_window(self, arrays: textdata.TextArrays, segment: jax.Array, first_row: jax.Array, rows: int,
                    carry_state: bool = True) -> textdata.TextWindow:
        """Segment `segment` of eval streams first_row .. first_row + rows - 1 of a held-out split's `arrays`:
        `carry_state=True` for `bpc`, False for `bpc_reset` (a reset at each segment's start). Targets past a
        stream's end are IGNORE, their inputs `padding_id`; score with `segment_totals`."""
        layout = textdata.EvalLayout(arrays.windows.shape[0], self.eval_streams, self.seq_len)
        return layout.window(arrays, segment, first_row, rows, carry_state, self.padding_id)

    # Scores.

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("bpc",)

    # What an evaluation reports (`rnnlab.steps.make_stream_evaluator`): bpc with the state carried through each
    # eval stream, and bpc_reset with it reset at every segment (results.json's eval_metrics holds both).
    eval_metric_names = ("bpc", "bpc_reset")

    @property
    def baselines(self) -> dict[str, float]:
        """Further eval scalars: `baseline_bpc`, the unigram entropy of the training text in bits."""
        return {"baseline_bpc": unigram_baseline_bpc(self)}

    def loss_and_metrics(self, outputs, targets):
        """outputs f32[B, T, 256] logits, targets int32[B, T] (IGNORE where not scored) -> (mean cross-entropy
        over the scored positions, in nats; {bpc})."""
        scored = targets != IGNORE
        labels = jnp.where(scored, targets, 0)
        losses = jnp.where(scored, optax.softmax_cross_entropy_with_integer_labels(outputs, labels), 0.0)
        loss = losses.sum() / jnp.maximum(scored.sum(), 1)
        return loss, {"bpc": textdata.bits(loss)}

    def metrics_from_totals(self, totals):
        """The mean over every scored position of the summed `segment_totals` (a whole held-out text)."""
        loss = totals["loss"].sum() / jnp.maximum(totals["scored"].sum(), 1)
        return loss, {"bpc": textdata.bits(loss)}

    def sample_one(self, key):
        """A window at a random offset of the training text -> (inputs int32[T], targets int32[T]): what a
        key-based sampler gets (the shapes `rnnlab.setup` checks; random crops). Training proper reads the
        streams in order (`sample_step`)."""
        text = jnp.asarray(self.splits["train"].text)
        start = jax.random.randint(key, (), 0, text.shape[0] - self.seq_len)
        window = jax.lax.dynamic_slice_in_dim(text, start, self.seq_len + 1).astype(jnp.int32)
        return window[:-1], window[1:]

    def describe_examples(self, inputs: np.ndarray, targets: np.ndarray, outputs: np.ndarray) -> str | None:
        """A few eval windows as text: the input, and the model's most likely next byte at each position."""
        rows = ["| input | predicted next bytes | right |", "|---|---|---|"]
        for x, y, out in zip(inputs, targets, outputs.argmax(-1)):
            scored = y != IGNORE
            shown = [_escaped(textdata.decode(x[scored])), _escaped(textdata.decode(out[scored]))]
            rows.append(f"| `{shown[0]}` | `{shown[1]}` | {int((out[scored] == y[scored]).sum())}/{int(scored.sum())} |")
        return "\n".join(rows)


def _escaped(text: str) -> str:
    """One Markdown table cell: newlines shown as ⏎, backticks and bars escaped."""
    return text.replace("\r", "").replace("\n", "⏎").replace("`", "'").replace("|", "\\|")


def unigram_baseline_bpc(task: TextTask) -> float:
    """The baseline in bits per character (`baseline_loss` / ln 2)."""
    return textdata.bits(task.baseline_loss)

