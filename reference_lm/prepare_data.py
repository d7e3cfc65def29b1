"""Tokenizer and token files for the reference LM, from the Gutenberg corpus.

    python reference_lm/prepare_data.py --corpus ../shared/data/corpus --out build/reference_lm

Splits by book (seeded), trains a byte-level BPE on the training books only (digits split one
per token so pass keys copy digit by digit), and writes train.bin / val.bin (uint16 ids, each
book followed by EOS), tokenizer.json, tokenizer_config.json and meta.json.
"""

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_lm.passkey import PasskeyCodec

BOS, EOS = "<s>", "</s>"  # ids 0 and 1
MAX_LENGTH = 4096  # the model's max_position_embeddings


def clean(text: str) -> str:
    """CRLF -> LF; unwrap Project Gutenberg's ~70-column lines so text reads like unwrapped prose."""
    text = re.sub(r"[ \t]*\r?\n[ \t]*", "\n", text)
    text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_books(corpus: Path) -> dict[str, str]:
    """Book path -> cleaned body text (between the PG START/END markers, per MANIFEST.tsv)."""
    root = corpus / "gutenberg"
    header, *rows = (root / "MANIFEST.tsv").read_text(encoding="utf-8").splitlines()
    books = {}
    for row in rows:
        r = dict(zip(header.split("\t"), row.split("\t")))
        raw = (root / r["path"]).read_bytes()[int(r["body_start_byte"]) : int(r["body_end_byte"])]
        books[r["path"]] = clean(raw.decode("utf-8"))
    return books


def split_books(names: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    names = sorted(names)
    random.Random(seed).shuffle(names)
    n_val = max(1, round(val_fraction * len(names)))
    return sorted(names[n_val:]), sorted(names[:n_val])


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # encode() with special tokens prepends BOS, as training does at each sequence start.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def encode_books(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos], np.uint16) for e in encoded])


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="folder holding gutenberg/MANIFEST.tsv")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    assert args.vocab <= 1 << 16, "ids are stored as uint16"
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)

    books = read_books(args.corpus)
    train_names, val_names = split_books(list(books), args.val_fraction, args.seed)
    t_read = time.time()
    tok = train_tokenizer([books[n] for n in train_names], args.vocab)
    t_tok = time.time()
    train_ids = encode_books(tok, [books[n] for n in train_names])
    val_ids = encode_books(tok, [books[n] for n in val_names])
    t_enc = time.time()

    train_ids.tofile(args.out / "train.bin")
    val_ids.tofile(args.out / "val.bin")
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "bos_id": bos_id,
        "eos_id": eos_id,
        "seed": args.seed,
        "val_fraction": args.val_fraction,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "train_bytes": sum(len(books[n].encode()) for n in train_names),
        "val_bytes": sum(len(books[n].encode()) for n in val_names),
        "train_books": train_names,
        "val_books": val_names,
        "passkey": PasskeyCodec.from_tokenizer(tok, bos_id, eos_id).to_json(),
        "seconds": {
            "read": t_read - t0,
            "tokenizer": t_tok - t_read,
            "encode": t_enc - t_tok,
            "total": time.time() - t0,
        },
        "command": " ".join(["python", "reference_lm/prepare_data.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"{len(train_names)} train / {len(val_names)} val books; {train_ids.size:,} / {val_ids.size:,} tokens; "
        f"vocab {meta['vocab_size']}; read {t_read - t0:.0f}s, tokenizer {t_tok - t_read:.0f}s, "
        f"encode {t_enc - t_tok:.0f}s",
        flush=True,
    )
    return meta


if __name__ == "__main__":
    main()
