"""Pass-key retrieval format shared by training and evaluation.

A needle ("The pass key is 48213. ...") is hidden at some depth in filler text; the prompt ends
with a question whose greedy answer must be " 48213". Prompts are built from token ids so the
GPU side needs no tokenizer library: the tokenizer splits every digit into its own token, hence
the ids of a text with a key are the ids of the fixed pieces around it plus one id per digit.
"""

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
TEXTS = {"needle": NEEDLE, "question": QUESTION, "answer": ANSWER}
KEY_RANGE = (10000, 100000)  # 5-digit keys, lo inclusive, hi exclusive


def needle(key: int) -> str:
    return NEEDLE.format(key=key)


def question() -> str:
    return QUESTION


def answer(key: int) -> str:
    return ANSWER.format(key=key)


def _encode(tokenizer, text: str) -> list[int]:
    """Ids without special tokens, for a `tokenizers.Tokenizer` or a transformers tokenizer."""
    if not text:
        return []
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))


class PasskeyCodec:
    """Token ids of the pass-key texts; from a tokenizer, or from the dict that `to_json` saved."""

    def __init__(self, pieces: dict[str, list[list[int]]], digits: list[int], bos_id: int, eos_id: int):
        self.pieces, self.digits, self.bos_id, self.eos_id = pieces, digits, bos_id, eos_id

    @classmethod
    def from_tokenizer(cls, tokenizer, bos_id: int, eos_id: int) -> "PasskeyCodec":
        digits = [_encode(tokenizer, str(d)) for d in range(10)]
        if any(len(d) != 1 for d in digits):
            raise ValueError("the tokenizer must encode each digit as one token")
        pieces = {name: [_encode(tokenizer, c) for c in t.split("{key}")] for name, t in TEXTS.items()}
        return cls(pieces, [d[0] for d in digits], bos_id, eos_id)

    def to_json(self) -> dict:
        return {"pieces": self.pieces, "digits": self.digits, "bos_id": self.bos_id, "eos_id": self.eos_id}

    @classmethod
    def from_json(cls, d: dict) -> "PasskeyCodec":
        return cls(d["pieces"], d["digits"], d["bos_id"], d["eos_id"])

    def ids(self, name: str, key: int | None = None) -> list[int]:
        """Ids of TEXTS[name] with `key` filled in."""
        chunks = self.pieces[name]
        out = list(chunks[0])
        for chunk in chunks[1:]:
            out += [self.digits[int(c)] for c in str(key)] + chunk
        return out


def build_prompt(codec: PasskeyCodec, filler, key: int, length: int, depth: float) -> tuple[list[int], int]:
    """[BOS] + filler with the needle at `depth` (0 = first, 1 = last) + question, exactly `length` ids.

    Returns the ids and the index where the needle starts. `filler` (ids, list or array) must hold
    at least as many ids as the prompt needs; its first ones are used.
    """
    nd, q = codec.ids("needle", key), codec.ids("question")
    n_fill = length - 1 - len(nd) - len(q)
    if n_fill < 0 or len(filler) < n_fill:
        raise ValueError(f"length {length} too short, or filler ({len(filler)} ids) too short")
    cut = round(depth * n_fill)
    fill = [int(t) for t in filler[:n_fill]]
    return [codec.bos_id] + fill[:cut] + nd + fill[cut:] + q, 1 + cut
