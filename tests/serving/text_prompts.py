"""Prompt sets built from real text (../shared/data here, .gpukit/w2/data in the device kit) for the serving GPU
scripts: the speculative-decoding identity check (test_gpu_spec_decode) and the `vllm bench serve` soak
(test_gpu_soak). Pure Python, deterministic for a seed; no tokenizer (lengths are in words).

A data folder may hold any of: wikitext2-test.txt (WikiText-2 raw, split into its articles), paul_graham_essays/*.txt,
books/**/*.txt or corpus/gutenberg/**/*.txt (Project Gutenberg files: the text between the START and END markers).
Each source becomes one stream of words; passages are windows of it that start after a sentence's end.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

MAX_BOOKS = 8  # of the (sorted) book files: enough text, a bounded read (the corpus holds ~100 MB)
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")
_WIKI_HEADING = re.compile(r"^ =( =)+ .* =( =)+ $")
_WIKI_JOINS = {" @-@ ": "-", " @,@ ": ",", " @.@ ": "."}
_PG_START = re.compile(r"^\*\*\* ?START OF .*$", re.MULTILINE)
_PG_END = re.compile(r"^\*\*\* ?END OF .*$", re.MULTILINE)
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def wikitext_articles(text: str) -> list[str]:
    """WikiText-2 raw's articles (each from its " = Title = " line), headings dropped, its split tokens joined."""
    articles: list[list[str]] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if _WIKI_TITLE.match(line):
            articles.append([])
            continue
        if not line.strip() or _WIKI_HEADING.match(line) or not articles:
            continue
        for k, v in _WIKI_JOINS.items():
            line = line.replace(k, v)
        articles[-1].append(line.strip())
    return [" ".join(a) for a in articles if a]


def gutenberg_body(text: str) -> str:
    """A Project Gutenberg file's text between its START and END marker lines (all of it without them)."""
    text = text.replace("\r\n", "\n")
    start, end = _PG_START.search(text), _PG_END.search(text)
    lo = start.end() if start else 0
    hi = end.start() if end and end.start() > lo else len(text)
    return text[lo:hi]


def read_sources(data_dir: str | Path, max_books: int = MAX_BOOKS) -> dict[str, list[str]]:
    """The documents of each source the folder holds: wikitext, essays, books (empty sources left out)."""
    data = Path(data_dir)
    if not data.is_dir():
        raise FileNotFoundError(f"{data}: no such data folder")
    sources: dict[str, list[str]] = {}
    wiki = data / "wikitext2-test.txt"
    if wiki.is_file():
        sources["wikitext"] = wikitext_articles(wiki.read_text(encoding="utf-8", errors="replace"))
    essays = sorted((data / "paul_graham_essays").glob("*.txt"))
    if essays:
        sources["essays"] = [p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n") for p in essays]
    books = sorted([*(data / "books").rglob("*.txt"), *(data / "corpus" / "gutenberg").rglob("*.txt")])
    if books:
        sources["books"] = [gutenberg_body(p.read_text(encoding="utf-8", errors="replace"))
                            for p in books[:max_books]]
    sources = {k: [d for d in v if d.strip()] for k, v in sources.items()}
    sources = {k: v for k, v in sources.items() if v}
    if not sources:
        raise FileNotFoundError(f"{data}: no wikitext2-test.txt, paul_graham_essays/ or books/ text in it")
    return sources


class Passages:
    """Windows of real text: one word stream per source, the sources taken in turn."""

    def __init__(self, sources: dict[str, list[str]], seed: int = 0):
        self.streams = {name: " ".join(docs).split() for name, docs in sorted(sources.items())}
        self.rng = random.Random(seed)
        self.turn = 0

    def take(self, words: int) -> tuple[str, str]:
        """(source, passage): `words` words from the next source long enough, starting after a sentence's end."""
        names = list(self.streams)
        for _ in range(len(names)):
            name = names[self.turn % len(names)]
            self.turn += 1
            stream = self.streams[name]
            if len(stream) >= words + 1:
                break
        else:
            longest = max(len(s) for s in self.streams.values())
            raise ValueError(f"no source holds {words + 1} words (the longest: {longest})")
        last = len(stream) - words
        start = self.rng.randrange(0, last + 1)
        for i in range(start, min(start + 200, last)):  # the first sentence start within 200 words
            if _SENTENCE_END.search(stream[i]):
                start = i + 1
                break
        return name, " ".join(stream[start:start + words])


def repetitive_prompt(passage: str, style: int) -> str:
    """A prompt whose continuation repeats text it already holds (n-gram speculation finds its drafts there)."""
    words = passage.split()
    lead = " ".join(words[: max(4, len(words) // 8)])
    if style % 3 == 0:
        return f"{passage}\n\n{passage}\n\n{lead}"
    if style % 3 == 1:
        return f"Copy the text exactly.\n\nText: {passage}\n\nCopy: {passage}\n\nText: {passage}\n\nCopy:"
    return "\n".join([passage] * 3 + [lead])


def spec_prompt_set(sources: dict[str, list[str]], repetitive: int, plain: int, seed: int = 0,
                    repetitive_words: tuple[int, int] = (30, 80), plain_words: tuple[int, int] = (40, 300)
                    ) -> dict[str, list[dict]]:
    """The speculative-decoding prompts: `repetitive` ones (a passage repeated, to be continued: drafts accept) and
    `plain` passages of real text (continued as they are). Each: {"prompt", "source", "style"}."""
    passages = Passages(sources, seed)
    rng = random.Random(seed + 1)
    rep = []
    for i in range(repetitive):
        source, p = passages.take(rng.randint(*repetitive_words))
        rep.append(dict(prompt=repetitive_prompt(p, i), source=source, style=f"repeat{i % 3}"))
    flat = []
    for _ in range(plain):
        source, p = passages.take(rng.randint(*plain_words))
        flat.append(dict(prompt=p, source=source, style="plain"))
    return {"repetitive": rep, "plain": flat}


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def soak_prompt_set(sources: dict[str, list[str]], n: int, seed: int = 0, prompt_words: tuple[int, int] = (16, 640),
                    answer_words: tuple[int, int] = (8, 380), median_prompt_words: int = 160,
                    median_answer_words: int = 90, sigma: float = 0.9) -> list[dict]:
    """Mixed-length requests, as chat logs have them (ShareGPT-like: lognormal prompt and answer lengths, clipped):
    {"prompt": a passage of real text, "answer": the passage after it, whose length (in tokens) is what a benchmark
    asks to generate}."""
    if n < 1:
        raise ValueError("n must be >= 1")
    passages = Passages(sources, seed)
    rng = random.Random(seed + 1)
    rows = []
    for _ in range(n):
        words = lognormal_int(rng, median_prompt_words, sigma, *prompt_words)
        answer = lognormal_int(rng, median_answer_words, sigma, *answer_words)
        _, text = passages.take(words + answer)
        split = text.split()
        rows.append(dict(prompt=" ".join(split[:words]), answer=" ".join(split[words:])))
    return rows


def write_sharegpt(path: str | Path, rows: list[dict]) -> Path:
    """rows in the ShareGPT JSON `vllm bench serve --dataset-name sharegpt` reads (pure JSON: no pandas, which its
    custom JSONL reader needs): the first turn the prompt, the second the answer, whose token count is the request's
    output length."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = [{"id": f"soak-{i}", "conversations": [{"from": "human", "value": r["prompt"]},
                                                  {"from": "gpt", "value": r["answer"]}]}
           for i, r in enumerate(rows)]
    path.write_text(json.dumps(doc))
    return path


def default_data_dir(root: Path) -> Path | None:
    """The text data: the device kit's copy (.gpukit/w2/data) or the shared folder beside the checkout."""
    for candidate in (root / ".gpukit" / "w2" / "data", root.parent / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    return None
