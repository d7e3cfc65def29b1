"""A tiny Gutenberg-like corpus (CRLF, wrapped lines, licence text around the body) and its prepared data."""

import random
import textwrap

import pytest
from tokenizers import Tokenizer

from reference_lm import prepare_data

WORDS = ["the", "a", "of", "and", "to", "in", "was", "he", "she", "it", "house", "letter", "captain", "pass", "key"]
HEADER = "The Project Gutenberg EBook LICENCE HEADER\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\n"
FOOTER = "\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nLICENCE FOOTER\r\n"
N_BOOKS = 6


def fake_book(rng: random.Random, n_paragraphs: int = 30) -> str:
    paragraphs = []
    for _ in range(n_paragraphs):
        words = [rng.choice(WORDS) if rng.random() > 0.05 else str(rng.randrange(1, 99999)) for _ in range(60)]
        paragraphs.append("\r\n".join(textwrap.wrap(" ".join(words).capitalize() + ".", 70)))
    return "\r\n\r\n".join(paragraphs)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """corpus/gutenberg/<Author>/<Title>.txt plus MANIFEST.tsv; returns (corpus dir, {path: body})."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    rows, bodies = ["path\tgit_blob_sha1\tbytes\tpg_ebook_no\tbody_start_byte\tbody_end_byte\tbody_words"], {}
    for i in range(N_BOOKS):
        path = f"Author {i}/Book {i}.txt"
        body = fake_book(rng)
        raw = (HEADER + body + FOOTER).encode()
        (root / "gutenberg" / f"Author {i}").mkdir(parents=True)
        (root / "gutenberg" / path).write_bytes(raw)
        start = len(HEADER.encode())
        rows.append(f"{path}\t0\t{len(raw)}\t{i}\t{start}\t{start + len(body.encode())}\t0")
        bodies[path] = body
    (root / "gutenberg" / "MANIFEST.tsv").write_text("\n".join(rows) + "\n")
    return root, bodies


@pytest.fixture(scope="session")
def data_dir(corpus, tmp_path_factory):
    """prepare_data.py's output for the tiny corpus: 2 of 6 books held out, a 400-token vocabulary."""
    out = tmp_path_factory.mktemp("data")
    prepare_data.main(["--corpus", str(corpus[0]), "--out", str(out), "--vocab", "400", "--val-fraction", "0.34"])
    return out


@pytest.fixture(scope="session")
def tokenizer(data_dir):
    return Tokenizer.from_file(str(data_dir / "tokenizer.json"))
