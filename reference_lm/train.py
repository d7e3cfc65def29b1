"""Train the reference LM on the tokens from prepare_data.py and save it in HF Llama format.

    python reference_lm/train.py --data build/reference_lm --out OUTDIR [--steps N] [--max-minutes M] [--tiny]

Needs only torch and numpy. Every sequence starts with BOS (as a served prompt does); a fraction
of them carry a pass-key needle at a random depth and the question + answer before a new document,
so the model learns long-range retrieval. The step count is fixed; --max-minutes only stops a run
early (recorded in train_log.json and the model card) so that it still saves within the call.
"""

import argparse
import contextlib
import json
import math
import shutil
import string
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_lm.model import Llama, ModelConfig, save_hf
from reference_lm.passkey import KEY_RANGE, PasskeyCodec, build_prompt

H200_PEAK_TFLOPS = 790  # dense bf16, for the utilisation figure in the log


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32  # sequences of seq_len: 131k tokens per step
    seq_len: int = 4096
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    passkey_fraction: float = 0.5  # the filler is real text, so pass-key sequences still teach language
    answer_weight: float = 10.0  # loss weight of the answer tokens: retrieval must form within the run
    log_every: int = 20
    eval_every: int = 500
    val_windows: int = 128
    passkey_per_length: int = 50  # x 4 lengths = 200 prompts
    seed: int = 0


TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
TINY_TRAIN = {
    "steps": 6,
    "batch_size": 4,
    "seq_len": 256,
    "warmup": 2,
    "log_every": 2,
    "eval_every": 3,
    "val_windows": 4,
    "passkey_per_length": 3,
}


def lr_at(step: int, c: TrainConfig) -> float:
    """Linear warmup, then cosine down to min_lr_frac * lr at the last step."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    p = (step - c.warmup) / max(1, c.steps - 1 - c.warmup)
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def window(tokens: np.ndarray, start: int, seq_len: int, bos: int) -> np.ndarray:
    """BOS + seq_len tokens: seq_len inputs and their seq_len next-token targets."""
    return np.concatenate([[bos], tokens[start : start + seq_len]]).astype(np.int64)


def passkey_sequence(tokens, codec: PasskeyCodec, seq_len: int, rng) -> tuple[np.ndarray, int, int]:
    """A pass-key prompt of random length and depth, its answer, EOS, then more text up to seq_len + 1.

    Returns the sequence, the index of the first answer token, and the answer length.
    """
    key = int(rng.integers(*KEY_RANGE))
    length = int(rng.integers(seq_len // 4, seq_len - 16 + 1))
    start = int(rng.integers(0, len(tokens) - seq_len))
    fill = tokens[start : start + seq_len]
    prompt, _ = build_prompt(codec, fill, key, length, float(rng.random()))
    ans = codec.ids("answer", key)
    rest = seq_len - length - len(ans)  # room left after the answer and EOS
    # The prompt used the head of `fill`; the tail (disjoint from it) follows the EOS.
    seq = np.concatenate([prompt, ans, [codec.eos_id], fill[len(fill) - rest :]]).astype(np.int64)
    return seq, length, len(ans)


def sample_batch(tokens, codec, c: TrainConfig, rng) -> tuple[np.ndarray, np.ndarray]:
    """[B, seq_len + 1] ids and [B, seq_len] per-target loss weights."""
    seqs = np.empty((c.batch_size, c.seq_len + 1), np.int64)
    weights = np.ones((c.batch_size, c.seq_len), np.float32)
    for b in range(c.batch_size):
        if rng.random() < c.passkey_fraction:
            seqs[b], at, n = passkey_sequence(tokens, codec, c.seq_len, rng)
            weights[b, at - 1 : at - 1 + n] = c.answer_weight  # targets are shifted by one
        else:
            seqs[b] = window(tokens, int(rng.integers(0, len(tokens) - c.seq_len)), c.seq_len, codec.bos_id)
    return seqs, weights


@torch.no_grad()
def val_loss(model, val, codec, c: TrainConfig, device, amp) -> float:
    """Mean next-token loss on fixed, evenly spaced windows of the validation split (no pass keys)."""
    starts = np.linspace(0, len(val) - c.seq_len - 1, min(c.val_windows, len(val) // c.seq_len)).astype(int)
    total, count = 0.0, 0
    for i in range(0, len(starts), c.batch_size):
        x = torch.from_numpy(np.stack([window(val, s, c.seq_len, codec.bos_id) for s in starts[i : i + c.batch_size]]))
        x = x.to(device)
        with amp:
            logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


def passkey_lengths(seq_len: int) -> list[int]:
    return [seq_len // 4, seq_len // 2, 3 * seq_len // 4, seq_len - 16]


@torch.no_grad()
def passkey_accuracy(model, val, codec, c: TrainConfig, device, amp) -> dict:
    """Exact-match greedy retrieval on validation filler, per prompt length and overall.

    Teacher forcing the answer and checking every answer position's argmax is the same test as
    greedy decoding (each greedy token is right iff the argmax given the right prefix is).
    """
    rng = np.random.default_rng(c.seed + 1)  # the same prompts at every evaluation
    n = c.passkey_per_length
    result = {}
    for length in passkey_lengths(c.seq_len):
        rows, answers = [], []
        for i in range(n):
            key = int(rng.integers(*KEY_RANGE))
            s = int(rng.integers(0, len(val) - length))
            prompt, _ = build_prompt(codec, val[s : s + length], key, length, (i + 0.5) / n)
            answers.append(codec.ids("answer", key))
            rows.append(prompt + answers[-1])
        x, ans = torch.tensor(rows, device=device), torch.tensor(answers, device=device)
        correct = 0
        for i in range(0, n, c.batch_size):
            with amp:
                logits = model(x[i : i + c.batch_size, :-1])
            pred = logits[:, length - 1 :].argmax(-1)
            correct += (pred == ans[i : i + c.batch_size]).all(-1).sum().item()
        result[str(length)] = correct / n
    result["all"] = sum(result.values()) / len(result)
    return result


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """6 x matmul params (tied head included) + causal attention (QK^T and PV, fwd + bwd)."""
    d = m.num_attention_heads * m.head_dim
    attn = m.hidden_size * (2 * d + 2 * m.num_key_value_heads * m.head_dim)
    per_layer = attn + 3 * m.hidden_size * m.intermediate_size
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    return 6 * params + 6 * m.num_hidden_layers * seq_len * d


def write_model_card(out: Path, record: dict) -> None:
    template = string.Template((Path(__file__).parent / "MODEL_CARD.md").read_text())
    m, t, f = record["model"], record["train"], record["final"]
    early = (
        f"**Stopped early** by --max-minutes at step {record['steps_done']} of {t['steps']}; "
        "the learning-rate schedule did not finish."
        if record["stopped_early"]
        else ""
    )
    by_len = ", ".join(f"{k} tokens {v:.1%}" for k, v in f["passkey"].items() if k != "all")
    val_curve = "; ".join(f"{e['step']}: {e['val_loss']:.3f}, {e['passkey']['all']:.0%}" for e in record["evals"])
    params = record["params"]
    (out / "README.md").write_text(
        template.substitute(
            hidden=m["hidden_size"],
            inter=m["intermediate_size"],
            layers=m["num_hidden_layers"],
            heads=m["num_attention_heads"],
            kv_heads=m["num_key_value_heads"],
            head_dim=m["head_dim"],
            vocab=m["vocab_size"],
            max_pos=m["max_position_embeddings"],
            rope_theta=m["rope_theta"],
            params=f"{params:,}",
            mbytes=f"{2 * params / 1e6:.1f}",
            n_books=len(record["data"]["train_books"]) + len(record["data"]["val_books"]),
            train_books=len(record["data"]["train_books"]),
            val_books=len(record["data"]["val_books"]),
            train_tokens=f"{record['data']['train_tokens']:,}",
            val_tokens=f"{record['data']['val_tokens']:,}",
            steps=record["steps_done"],
            batch=t["batch_size"],
            seq_len=t["seq_len"],
            tokens_seen=f"{record['tokens_seen']:,}",
            epochs=f"{record['tokens_seen'] / record['data']['train_tokens']:.1f}",
            passkey_fraction=f"{t['passkey_fraction']:.0%}",
            answer_weight=f"{t['answer_weight']:g}",
            lr=t["lr"],
            warmup=t["warmup"],
            train_loss=f"{f['train_loss']:.3f}",
            val_loss=f"{f['val_loss']:.3f}",
            passkey_all=f"{f['passkey']['all']:.1%}",
            passkey_by_len=by_len,
            val_curve=val_curve,
            n_passkey=4 * t["passkey_per_length"],
            early=early,
            wall=f"{record['wall_seconds']:.0f}",
            device=record["device"],
            command=record["command"],
        )
    )


def main(argv=None) -> Llama:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="output folder of prepare_data.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, help=f"default {TrainConfig.steps} ({TINY_TRAIN['steps']} with --tiny)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=8.5,
        help="stop training early (then evaluate and save) after this many minutes (imports not counted)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny model and few steps, for CPU tests")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    args = p.parse_args(argv)
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)

    command = " ".join(["python", "reference_lm/train.py", *(argv if argv is not None else sys.argv[1:])])

    meta = json.loads((args.data / "meta.json").read_text())
    codec = PasskeyCodec.from_json(meta["passkey"])
    mcfg = ModelConfig(vocab_size=meta["vocab_size"], **(TINY_MODEL if args.tiny else {}))
    tcfg = TrainConfig(**(TINY_TRAIN if args.tiny else {}))
    if args.steps is not None:
        tcfg = replace(tcfg, steps=args.steps)
    assert tcfg.seq_len <= mcfg.max_position_embeddings
    train_ids = np.fromfile(args.data / "train.bin", np.uint16)
    val_ids = np.fromfile(args.data / "val.bin", np.uint16)

    torch.manual_seed(tcfg.seed)
    rng = np.random.default_rng(tcfg.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # bf16 autocast over fp32 master weights on the GPU; plain fp32 on the CPU (tests).
    amp = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()
    if cuda:  # flash attention only: fail loudly rather than fall back to the O(T^2)-memory math kernel
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = Llama(mcfg).to(device)
    model.init_weights()
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tcfg.lr, betas=(0.9, 0.95), fused=cuda)
    fwd = torch.compile(model) if args.compile else model
    flops = model_flops_per_token(mcfg, tcfg.seq_len)
    log(
        f"{params:,} params ({2 * params / 1e6:.1f} MB bf16), {len(train_ids):,} train / {len(val_ids):,} val tokens, "
        f"device {device}, {tcfg.steps} steps x {tcfg.batch_size} x {tcfg.seq_len}"
    )

    history, evals = [], []

    def evaluate(step):
        e = {
            "step": step,
            "val_loss": val_loss(model, val_ids, codec, tcfg, device, amp),
            "passkey": passkey_accuracy(model, val_ids, codec, tcfg, device, amp),
        }
        evals.append(e)
        log(f"eval step {step}: val loss {e['val_loss']:.4f}, pass-key {e['passkey']}")

    step, stopped_early, t_train, t_last, tok_last = 0, False, time.time(), time.time(), 0
    while step < tcfg.steps:
        if step > 0 and time.time() - start > 60 * args.max_minutes:
            stopped_early = True
            log(f"stopping early at step {step}: --max-minutes {args.max_minutes} reached")
            break
        seqs, weights = sample_batch(train_ids, codec, tcfg, rng)
        x, w = torch.from_numpy(seqs).to(device), torch.from_numpy(weights).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tcfg)
        with amp:
            logits = fwd(x[:, :-1])
        ce = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="none")
        loss = (ce * w.flatten()).sum() / w.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % tcfg.log_every == 0 or step == tcfg.steps:
            now, tokens = time.time(), step * tcfg.batch_size * tcfg.seq_len
            tok_s = (tokens - tok_last) / (now - t_last)
            lr = lr_at(step - 1, tcfg)
            history.append(
                {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr, "tok_per_s": tok_s}
            )
            eta = (tcfg.steps - step) * (now - t_train) / step
            log(
                f"step {step}/{tcfg.steps} loss {history[-1]['loss']:.4f} grad norm {history[-1]['grad_norm']:.2f} lr {lr:.2e} "
                f"{tok_s / 1e6:.3f}M tok/s {tok_s * flops / 1e12:.0f} TFLOP/s "
                f"({tok_s * flops / 1e12 / H200_PEAK_TFLOPS:.0%} of H200 peak) eta {eta:.0f}s"
            )
            t_last, tok_last = now, tokens
        if step % tcfg.eval_every == 0 and step < tcfg.steps:
            evaluate(step)
            t_last, tok_last = time.time(), step * tcfg.batch_size * tcfg.seq_len  # evaluation is not training speed
    train_seconds = time.time() - t_train
    evaluate(step)

    record = {
        "command": command,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "model": asdict(mcfg),
        "train": asdict(tcfg),
        "params": params,
        "steps_done": step,
        "stopped_early": stopped_early,
        "tokens_seen": step * tcfg.batch_size * tcfg.seq_len,
        "train_seconds": train_seconds,
        "final": {"train_loss": loss.item(), "val_loss": evals[-1]["val_loss"], "passkey": evals[-1]["passkey"]},
        "history": history,
        "evals": evals,
        "data": {k: meta[k] for k in ("train_tokens", "val_tokens", "train_books", "val_books", "vocab_size", "seed")},
    }
    save_hf(model, args.out, codec.bos_id, codec.eos_id)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.data / name, args.out / name)
    record["wall_seconds"] = time.time() - start
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    write_model_card(args.out, record)
    final = record["final"]
    log(
        f"saved {args.out}: val loss {final['val_loss']:.4f}, pass-key {final['passkey']['all']:.1%}, "
        f"{record['tokens_seen']:,} tokens, wall {record['wall_seconds']:.0f}s"
    )
    return model


if __name__ == "__main__":
    main()
