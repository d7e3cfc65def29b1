"""How far a rounding-sized difference moves a real model's greedy text, per KV cache (CPU, transformers, bf16).

Two kernels that compute the same attention in another order (a speculative verification and a decode step, two
split counts, two GEMM shapes) differ in the last bit of a few outputs. With a bf16 cache that difference fades;
with a quantized one it can move the next token's key or value across a decision boundary of the quantizer, a jump
of a whole quantization step that later tokens attend to. Measured here: greedy decoding of --prompts WikiText-2
passages (--prompt-len tokens, --tokens generated) twice per KV cache, the second time with one bf16 ulp added to or
taken from a random --flip fraction of every attention output (the o_proj input); reported: the prompts whose greedy
text parts, where, the unperturbed run's margin (nats between its top two tokens) there, and the largest change of
a next-token log-probability at the positions before the texts part.

Then the same question as the vLLM speculative-decoding check, asked of transformers alone (none of our kernels): per
KV cache, --lookup-prompts passages decoded greedily one at a time, with transformers' n-gram speculation (prompt
lookup, --lookup-tokens drafts; rejected drafts cropped from the cache), and beside another passage in a batch of two
(the control: other GEMM shapes, no speculation); reported: the prompts whose text speculation parts from greedy's,
and those the batch of two parts.

KV caches: bf16 (transformers' DynamicCache), fp8 (keys and values rounded to e4m3 where the projections write them,
no scale: a stand-in for vLLM's fp8 cache), tq4 and tq3 (turboquant_vllm.hf.TurboQuantCache, the vLLM backend's
stored format).

    python -m benchmarks rounding_sensitivity --model DIR --wikitext FILE [--prompts 32] [--prompt-len 256]
        [--tokens 64] [--flip 0.05] [--lookup-prompts 24] [--lookup-tokens 3]
Prints its findings after a provenance header (log: benchmarks/results/quality_diagnosis/).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import common

NAME = "rounding_sensitivity"
CACHES = ("bf16", "fp8", "tq4", "tq3")


def flip_ulps(x: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """x with a random `fraction` of its elements moved to the next representable value up or down (half each)."""
    r = torch.rand(x.shape, generator=gen).to(x.device)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    down = torch.nextafter(x, torch.full_like(x, float("-inf")))
    return torch.where(r < fraction / 2, down, torch.where(r > 1 - fraction / 2, up, x))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first position where the token rows a and b differ; None when equal."""
    diff = (a != b).nonzero()
    return int(diff[0]) if len(diff) else None


class Model:
    """A transformers causal LM with hooks: the attention outputs perturbed (flip_ulps) and, for the fp8 cache, the
    key / value projections rounded to e4m3."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.flip, self.fp8, self.gen = 0.0, False, torch.Generator()
        for layer in self.lm.model.layers:
            layer.self_attn.o_proj.register_forward_pre_hook(self._perturb)
            layer.self_attn.k_proj.register_forward_hook(self._round_fp8)
            layer.self_attn.v_proj.register_forward_hook(self._round_fp8)

    def _perturb(self, module, args):
        return (flip_ulps(args[0], self.flip, self.gen),) if self.flip else None

    def _round_fp8(self, module, args, out):
        return out.to(torch.float8_e4m3fn).to(out.dtype) if self.fp8 else None

    def _cache(self, cache: str, flip: float):
        """A fresh cache of that name, with the hooks set for it (fp8 rounding) and the perturbation's fraction."""
        from transformers import DynamicCache

        from turboquant_vllm.hf.cache import TurboQuantCache

        self.flip, self.fp8 = flip, cache == "fp8"
        return DynamicCache() if cache in ("bf16", "fp8") else TurboQuantCache(cache)

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, tokens: int, cache: str, flip: float, seed: int = 1):
        """Greedy tokens, each step's top-two margin (nats) and log-probabilities, batch-first."""
        kv = self._cache(cache, flip)
        self.gen.manual_seed(seed)
        logits = self.lm(prompts, past_key_values=kv, use_cache=True).logits[:, -1].float()
        out, margins, logps = [], [], []
        for _ in range(tokens):
            logp = logits.log_softmax(-1)
            top = logp.topk(2, dim=-1)
            out.append(top.indices[:, 0])
            margins.append(top.values[:, 0] - top.values[:, 1])
            logps.append(logp)
            logits = self.lm(out[-1][:, None], past_key_values=kv, use_cache=True).logits[:, -1].float()
        return torch.stack(out, 1), torch.stack(margins, 1), torch.stack(logps, 1)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, tokens: int, cache: str, lookup: int = 0) -> torch.Tensor:
        """transformers' greedy generate (prompt-lookup speculation with `lookup` drafts), the new tokens only."""
        from turboquant_vllm.hf.demo import with_cache

        kv = self._cache(cache, 0.0)
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        out = self.lm.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens,
                               min_new_tokens=tokens, do_sample=False, **with_cache(self.lm, kv), **extra)
        return out[:, prompts.shape[1]:]


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--model", type=Path, required=True, help="the converted SmolLM2 directory")
    ap.add_argument("--wikitext", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--flip", type=float, default=0.05, help="fraction of attention outputs moved one ulp")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--lookup-prompts", type=int, default=24, help="passages of the speculation part (0: skip it)")
    ap.add_argument("--lookup-tokens", type=int, default=3, help="drafts a step of prompt-lookup speculation")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    common.print_header(common.command_line(NAME, argv))
    torch.manual_seed(0)
    ids = AutoTokenizer.from_pretrained(args.model)(args.wikitext.read_text(), return_tensors="pt").input_ids[0]
    stride = (len(ids) - args.prompt_len) // args.prompts
    prompts = torch.stack([ids[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)])
    model = Model(args.model)
    print(f"{args.prompts} WikiText-2 passages of {args.prompt_len} tokens, {args.tokens} greedy tokens, one bf16 ulp "
          f"on {args.flip:.0%} of every attention output\n")
    print("| KV cache | prompts parted | median position | margin there: median / max (nats) | "
          "largest log-prob change before: median / p90 / max |")
    print("| --- | --- | --- | --- | --- |")
    for cache in args.caches.split(","):
        a, margin, logp_a = model.greedy(prompts, args.tokens, cache, 0.0)
        b, _, logp_b = model.greedy(prompts, args.tokens, cache, args.flip)
        parted = [(i, p) for i in range(len(a)) if (p := first_difference(a[i], b[i])) is not None]
        at = torch.tensor([margin[i, p].item() for i, p in parted]) if parted else torch.zeros(1)
        pos = torch.tensor([float(p) for _, p in parted]) if parted else torch.zeros(1)
        same = torch.cumprod((a == b).long(), 1).bool()  # positions before the texts part
        change = (logp_a - logp_b).abs().amax(-1)[same]
        print(f"| {cache} | {len(parted)} / {len(a)} | {pos.median():.0f} | {at.median():.3f} / {at.max():.3f} | "
              f"{change.median():.3f} / {change.quantile(0.9):.3f} / {change.max():.3f} |", flush=True)
    if args.lookup_prompts:
        speculation(model, prompts[: args.lookup_prompts], args)


def speculation(model: Model, prompts: torch.Tensor, args) -> None:
    """Per KV cache: the prompts whose greedy text speculation parts, and those a batch of two parts."""
    print(f"\n{len(prompts)} of the passages one at a time: greedy, prompt-lookup speculation ({args.lookup_tokens} "
          f"drafts), and greedy beside the next passage in a batch of two (the control); {args.tokens} tokens\n")
    print("| KV cache | speculation parts greedy's text | a batch of two parts it |")
    print("| --- | --- | --- |")
    for cache in args.caches.split(","):
        spec_parted = pair_parted = 0
        for i in range(len(prompts)):
            alone = model.generate(prompts[i : i + 1], args.tokens, cache)[0]
            spec = model.generate(prompts[i : i + 1], args.tokens, cache, args.lookup_tokens)[0]
            pair = model.generate(prompts[[i, (i + 1) % len(prompts)]], args.tokens, cache)[0]
            spec_parted += first_difference(alone, spec) is not None
            pair_parted += first_difference(alone, pair) is not None
        print(f"| {cache} | {spec_parted} / {len(prompts)} | {pair_parted} / {len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
