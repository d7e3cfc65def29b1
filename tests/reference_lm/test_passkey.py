import json

import numpy as np
import pytest

from reference_lm import passkey
from reference_lm.passkey import PasskeyCodec, build_prompt

KEYS = [10000, 48213, 99999, 70007]


@pytest.fixture(scope="module")
def codec(tokenizer):
    return PasskeyCodec.from_tokenizer(tokenizer, tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>"))


def test_ids_from_pieces_equal_tokenizing_the_text(codec, tokenizer):
    """The GPU side builds prompts from stored pieces; they must equal what the tokenizer makes of the text."""
    for key in KEYS:
        assert codec.ids("needle", key) == tokenizer.encode(passkey.needle(key), add_special_tokens=False).ids
        assert codec.ids("answer", key) == tokenizer.encode(passkey.answer(key), add_special_tokens=False).ids
        assert tokenizer.decode(codec.ids("answer", key)) == f" {key}"
    assert codec.ids("question") == tokenizer.encode(passkey.question(), add_special_tokens=False).ids
    assert PasskeyCodec.from_json(codec.to_json()).to_json() == codec.to_json()


def test_meta_json_carries_the_same_codec(codec, data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert PasskeyCodec.from_json(meta["passkey"]).to_json() == codec.to_json()


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("length", [60, 200])
def test_prompt_length_depth_and_answer(codec, tokenizer, depth, length):
    filler = np.arange(100, 100 + 300) % 350 + 2  # ids that are neither BOS/EOS nor needle-shaped
    key = 48213
    ids, at = build_prompt(codec, filler, key, length, depth)
    nd, q = codec.ids("needle", key), codec.ids("question")
    n_fill = length - 1 - len(nd) - len(q)
    assert len(ids) == length and ids[0] == codec.bos_id
    assert at == 1 + round(depth * n_fill)
    assert ids[at : at + len(nd)] == nd and ids[-len(q) :] == q
    assert ids[1:at] + ids[at + len(nd) : -len(q)] == filler[:n_fill].tolist()  # filler in order, none lost
    # The answer is the key written in the needle.
    text = tokenizer.decode(ids[at : at + len(nd)])
    assert text == passkey.needle(key) and passkey.answer(key).strip() in text


def test_prompt_too_short_is_refused(codec):
    with pytest.raises(ValueError):
        build_prompt(codec, list(range(2, 500)), 12345, 20, 0.5)
    with pytest.raises(ValueError):
        build_prompt(codec, list(range(2, 12)), 12345, 200, 0.5)


def test_digits_must_be_single_tokens():
    class TwoBytesPerChar:  # digits would not copy one token at a time
        def encode(self, text, add_special_tokens=False):
            return [b for c in text for b in (0, ord(c))]

    with pytest.raises(ValueError):
        PasskeyCodec.from_tokenizer(TwoBytesPerChar(), 0, 1)
