"""Where a real model's tq4 error comes from, and what per-token key centering buys (CPU, fp32 forward).

An HF Llama directory (e.g. SmolLM2-135M-Instruct from `turboquant-vllm model smollm2`) runs in fp32 through
reference_lm's Llama; each layer's K (post-RoPE, as cached) and V pass through core's quantize -> dequantize under a
configuration. Calibration (mean m and scale s per layer and KV head, core.calibration's formula) comes from
--calib-windows WikiText-2 windows disjoint from the scored ones.

1. attention error per layer (one window): ||o_proj(attn(q, K_hat, V_hat) - attn(q, K, V))||^2 over the
   reference's, for keys raw, centered, centered with the first token exact, and per-token centered (below).
2. KL(P_fp32 || Q) per position (full vocabulary) and the PPL change over --windows windows per configuration.
3. with per-layer configurations (below): per layer, the KL when only that layer's keys are 4-bit vs 5-bit
   (centered per token, values exact) and when only that layer is k5v4 centered per token, on a calibration
   window: the rankings behind "topN".

A configuration is one of CONFIGS, optionally with other bits in some layers: "tq4 centered per token + k5 layers
0,1,28,29" (5-bit keys, same values and centering there), "+ bf16 layers 12-28", "+ k5 layers top4" (the 4 layers
where 5-bit keys save the most KL, measured as in 3), "+ k4 layers top7" (4-bit keys where 5-bit ones save the
least), "+ bf16 layers top2" (where k5v4 alone costs the most KL), "+ sink key exact" (each window's first token,
the attention sink, keeps its exact key in every layer: 2 d bytes a sequence, not counted per token; "+ first N keys
exact": the first N tokens'), "+ key bits by channel 5x24,4x16,3x24" (below). Each row's bytes per token per KV head
average the layers; later parts override earlier ones.

Key centering caches (k - m) / s: exact for softmax (q.m is the same for every key) and it takes out the mean that
RoPE'd keys share. But attention-sink keys (e.g. a sequence's first token, which most heads attend to) are short
and far from the mean: centering makes exactly those vectors long and their error large. Per-token centering
("adaptive", the stored format): each key is stored centered or not, whichever vector is shorter, the choice in
the sign of its stored norm; scores subtract q.m for the uncentered ones.

Key bits by channel (transform coding): with x_c = sqrt(E[q_c^2] E[(k_c - m_c)^2]) per layer and KV head, equal bits
after calibration and rotation err in q.k by distortion(b, d) (sum_c x_c)^2 / d; bits matched to x (reverse
water-filling) by d GM(x^2) distortion(b, d), (AM(x) / GM(x))^2 less. "+ key bits by channel 5x24,4x16,3x24" ranks
the RoPE pairs (c, c + d/2) by x and gives the first 24 channels 5 bits, the next 16 4 bits, the last 24 3 bits: each
group its own rotation, norm and codebook (the extra groups' norms counted as fp16, simulated in fp32). The results
carry the predicted gain, per layer and KV head, of each such grouping and of the ideal allocation.

    python -m benchmarks key_centering --model DIR --wikitext wikitext2-test.txt [--windows 2 --seq-len 2048]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from reference_lm.model import Llama, ModelConfig, rope_cos_sin
from turboquant_vllm.core.codebook import codebook
from turboquant_vllm.core.packing import record_bytes
from turboquant_vllm.core.presets import NORM_BYTES
from turboquant_vllm.core.quantizer import Quantizer

from . import common

NAME = "key_centering"
CONFIGS = {  # name -> (key bits, value bits, key transform)
    "fp8 e4m3": ("fp8", "fp8", ""),
    "tq4": (4, 4, ""),
    "tq4 keys only": (4, None, ""),
    "tq4 values only": (None, 4, ""),
    "tq4 centered": (4, 4, "centered"),
    "tq4 centered per token": (4, 4, "adaptive"),
    "tq3": (3, 3, ""),
    "tq3 centered": (3, 3, "centered"),
    "tq3 centered per token": (3, 3, "adaptive"),
    "k5v4 centered per token": (5, 4, "adaptive"),
}
OVERRIDES = {"k5": lambda kb, vb, how: (5, vb, how), "k4": lambda kb, vb, how: (4, vb, how),
             "bf16": lambda kb, vb, how: ("bf16", "bf16", "")}
EXACT_KEYS = re.compile(r"sink key exact|first (\d+) keys exact")
KEY_GROUPS = re.compile(r"key bits by channel (\d+x\d+(?:,\d+x\d+)*)")


def exact_keys(name: str) -> int:
    """How many of each window's first tokens keep their exact keys ("+ sink key exact": 1), 0 if none."""
    found = [EXACT_KEYS.fullmatch(part.strip()) for part in name.split("+")[1:]]
    return max((int(m.group(1) or 1) for m in found if m), default=0)


def parse(name: str, num_layers: int, rankings: dict[str, list[int]] | None = None) -> dict[int, tuple]:
    """layer -> (key bits, value bits, key transform) of a configuration: CONFIGS[base] + "k5|k4|bf16 layers SPEC"s,
    SPEC a comma list of layers, ranges a-b and topN (the first N of rankings[k5|k4|bf16]); later parts win."""
    _, *parts = (part.strip() for part in name.split("+"))
    base = layers_of_base(name)
    layers = dict.fromkeys(range(num_layers), base)
    for part in parts:
        if EXACT_KEYS.fullmatch(part) or KEY_GROUPS.fullmatch(part):
            continue
        kind, spec = re.fullmatch(r"(\w+) layers (\S+)", part).groups()
        for item in spec.split(","):
            if item.startswith("top"):
                if rankings is None:
                    raise ValueError(f"{name!r}: topN needs the per-layer rankings")
                picked = rankings[kind][:int(item[3:])]
            else:
                lo, _, hi = item.partition("-")
                picked = range(int(lo), int(hi or lo) + 1)
            for i in picked:
                layers[i] = OVERRIDES[kind](*base)
    return layers


def layers_of_base(name: str) -> tuple:
    """CONFIGS[base]; "+ key bits by channel SPEC" makes its key bits the groups ((bits, channels), ...) of SPEC."""
    base = CONFIGS[name.split("+")[0].strip()]
    for part in name.split("+")[1:]:
        if groups := KEY_GROUPS.fullmatch(part.strip()):
            base = (tuple(tuple(map(int, g.split("x"))) for g in groups.group(1).split(",")), *base[1:])
    return base


def side_bytes(bits, d: int) -> int:
    """Bytes of one cached K or V vector of dim d: b-bit codes + fp32 norm, fp8, or 16-bit (None: kept exact)."""
    if isinstance(bits, tuple):  # channel groups: the first keeps the fp32 norm (its sign: centered or not), fp16 after
        return sum(record_bytes(n, b) for b, n in bits) + NORM_BYTES + 2 * (len(bits) - 1)
    return d if bits == "fp8" else 2 * d if bits in (None, "bf16") else record_bytes(d, bits) + NORM_BYTES


def bytes_per_token(layers: dict[int, tuple], d: int) -> float:
    """Bytes per token per KV head, the mean over layers."""
    return float(np.mean([side_bytes(kb, d) + side_bytes(vb, d) for kb, vb, _ in layers.values()]))


def load(path: Path) -> Llama:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    model = Llama(ModelConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(ModelConfig)}))
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(shard))
    state.pop("lm_head.weight", None)  # tied
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.float().eval()


def fake_quant(x: torch.Tensor, bits, order: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(bits, tuple):  # consecutive groups of the channels in `order`, each its own quantizer
        order = order.expand_as(x)
        y = x.gather(-1, order).split([n for _, n in bits], -1)
        return torch.empty_like(x).scatter_(-1, order, torch.cat([fake_quant(g, b) for g, (b, _) in zip(y, bits)], -1))
    if bits is None:
        return x
    if bits == "fp8":
        return x.to(torch.float8_e4m3fn).float()
    if bits == "bf16":
        return x.bfloat16().float()
    q = Quantizer(bits, x.shape[-1])
    return q.dequantize(*q.quantize(x))


def layer_qkv(model: Llama, i: int, x: torch.Tensor):
    """q, k (post-RoPE) and v of layer i for its input x [B, T, hidden], each [B, heads, T, d]."""
    a, c = model.model.layers[i].self_attn, model.config
    h = model.model.layers[i].input_layernorm(x)
    B, T, _ = h.shape
    cos, sin = rope_cos_sin(c, T, h.device)

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    q = rope(a.q_proj(h).view(B, T, a.n_heads, a.head_dim).transpose(1, 2))
    k = rope(a.k_proj(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2))
    return q, k, a.v_proj(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)


def forward(model: Llama, ids: torch.Tensor, hook=None, inputs: list | None = None, start: int = 0,
            x: torch.Tensor | None = None) -> torch.Tensor:
    """Logits; from layer `start` on with x its input (the reference's: the layers before it exact) if given."""
    cos, sin = rope_cos_sin(model.config, ids.shape[1], ids.device)
    x = model.model.embed_tokens(ids) if x is None else x
    for i, layer in enumerate(model.model.layers[start:], start):
        if inputs is not None:
            inputs.append(x)
        x = layer(x, cos, sin, None if hook is None else (lambda k, v, i=i: hook(i, k, v)))
    return F.linear(model.model.norm(x), model.model.embed_tokens.weight)


def calibrate(model: Llama, ids: torch.Tensor) -> dict:
    """layer -> (mean, scale, x), [1, kv_heads, 1, d]: core.calibration's s_c = (E[(k-m)^2] / E[q^2])^(1/4) and
    x_c = sqrt(E[(k-m)^2] E[q^2]), what key bits by channel follow."""
    inputs, out = [], {}
    with torch.inference_mode():
        forward(model, ids, inputs=inputs)
        for i, x in enumerate(inputs):
            q, k, _ = layer_qkv(model, i, x)
            kv, d = k.shape[1], k.shape[-1]
            mean = k.mean((0, 2), keepdim=True)
            var = (k - mean).pow(2).mean((0, 2), keepdim=True)
            qq = q.pow(2).view(q.shape[0], kv, -1, q.shape[2], d).mean((0, 2, 3))[None, :, None]
            log_s = 0.25 * (var.clamp_min(1e-12).log() - qq.clamp_min(1e-12).log())
            out[i] = (mean, (log_s - log_s.mean(-1, keepdim=True)).exp(), (var * qq).sqrt())
    return out


def channel_order(x: torch.Tensor) -> torch.Tensor:
    """The channels (last axis) as RoPE pairs (c, c + d/2) side by side, the pairs by x_c + x_{c+d/2} descending."""
    half = x.shape[-1] // 2
    pairs = (x[..., :half] + x[..., half:]).argsort(-1, descending=True)
    return torch.stack([pairs, pairs + half], -1).flatten(-2)


def predicted_gain(x: torch.Tensor, groups: tuple | None = None, bits: int = 4) -> torch.Tensor:
    """Key-logit error of `bits` bits everywhere after calibration and rotation over that of `groups` in
    channel_order, per row of x: a group of n channels at b bits errs by distortion(b, n) (its sum of x)^2 / n.
    Without groups the ideal allocation's at the same mean bits, (AM(x) / GM(x))^2."""
    if groups is None:
        return (x.mean(-1) / x.log().mean(-1).exp()) ** 2
    parts = x.gather(-1, channel_order(x)).split([n for _, n in groups], -1)
    err = sum(codebook(b, n).distortion * p.sum(-1) ** 2 / n for p, (b, n) in zip(parts, groups))
    return codebook(bits, x.shape[-1]).distortion * x.sum(-1) ** 2 / x.shape[-1] / err


def keys_through_cache(k: torch.Tensor, bits, how: str, cal: tuple | None) -> torch.Tensor:
    if bits is None or not how:
        return fake_quant(k, bits)
    m, s, x = cal
    order = channel_order(x)
    centered = (k - m) / s
    k_hat = fake_quant(centered, bits, order) * s + m
    if how == "adaptive":  # per token, whichever of (k - m) / s and k / s is shorter
        raw = k / s
        short = torch.linalg.vector_norm(raw, dim=-1, keepdim=True) < torch.linalg.vector_norm(centered, dim=-1,
                                                                                             keepdim=True)
        k_hat = torch.where(short, fake_quant(raw, bits, order) * s, k_hat)
    return k_hat


def attention_error(model: Llama, ids: torch.Tensor, cal: dict) -> list[dict]:
    """Per layer: the attention output's error through o_proj, relative, for tq4 keys under each transform."""
    rows, inputs = [], []
    with torch.inference_mode():
        forward(model, ids, inputs=inputs)
        for i, x in enumerate(inputs):
            a = model.model.layers[i].self_attn
            q, k, v = layer_qkv(model, i, x)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            base = a.o_proj(ref.transpose(1, 2).flatten(2)).pow(2).sum(-1).mean()
            first_exact = torch.cat([k[:, :, :1], keys_through_cache(k[:, :, 1:], 4, "centered", cal[i])], 2)
            variants = {"raw": fake_quant(k, 4), "centered": keys_through_cache(k, 4, "centered", cal[i]),
                        "centered, first token exact": first_exact,
                        "centered per token": keys_through_cache(k, 4, "adaptive", cal[i])}
            row = {"layer": i}
            for name, k_hat in variants.items():
                o = F.scaled_dot_product_attention(q, k_hat, v, is_causal=True, enable_gqa=True)
                row[name] = (a.o_proj((o - ref).transpose(1, 2).flatten(2)).pow(2).sum(-1).mean() / base).item()
            rows.append(row)
    return rows


LAYER_ALONE = {"k4": (4, None), "k5": (5, None), "k5v4": (5, 4)}  # column -> (key bits, value bits)


def key_bits_per_layer(model: Llama, ids: torch.Tensor, cal: dict, log=print) -> list[dict]:
    """Per layer: KL(P_fp32 || Q) when only that layer goes through the cache (keys centered per token) as each of
    LAYER_ALONE; "gain": what 5-bit keys there save over 4-bit ones."""
    rows, inputs = [], []
    with torch.inference_mode():
        logp_ref = forward(model, ids, inputs=inputs)[:, :-1].log_softmax(-1)
        for i, x in enumerate(inputs):
            row = {"layer": i}
            for col, (kb, vb) in LAYER_ALONE.items():
                def hook(j, k, v, kb=kb, vb=vb):
                    return (keys_through_cache(k, kb, "adaptive", cal[j]), fake_quant(v, vb)) if j == i else (k, v)

                logp = forward(model, ids, hook, start=i, x=x)[:, :-1].log_softmax(-1)
                row[col] = (logp_ref.exp() * (logp_ref - logp)).sum(-1).mean().item()
            row["gain"] = row["k4"] - row["k5"]
            rows.append(row)
            log(f"layer {i:2d}: " + "  ".join(f"{k} {v:.5f}" for k, v in row.items() if k != "layer"))
    return rows


def rankings_of(rows: list[dict]) -> dict[str, list[int]]:
    """The layers for "k5|k4|bf16 layers topN": where 5-bit keys save the most, the least, where k5v4 costs most."""
    def by(key):
        return [row["layer"] for row in sorted(rows, key=key)]

    return {"k5": by(lambda r: -r["gain"]), "k4": by(lambda r: r["gain"]), "bf16": by(lambda r: -r["k5v4"])}


def kl_and_ppl(model: Llama, windows: torch.Tensor, cal: dict, names: list[str], log=print,
               rankings: dict[str, list[int]] | None = None) -> dict:
    refs, out = [], {}
    with torch.inference_mode():
        for ids in windows.split(1):
            logp = forward(model, ids)[:, :-1].log_softmax(-1)
            refs.append((ids, logp, -logp.gather(-1, ids[:, 1:, None]).mean().item()))
        ref_nll = float(np.mean([r[2] for r in refs]))
        out["reference"] = {"ppl": math.exp(ref_nll)}
        for name in names:
            layers = parse(name, len(model.model.layers), rankings)
            t0, kls, nlls = time.perf_counter(), [], []

            def hook(i, k, v, layers=layers, n=exact_keys(name)):
                kb, vb, how = layers[i]
                k_hat = keys_through_cache(k, kb, how, cal[i])
                if n:  # the window's first n tokens (tokens on axis 2) keep their exact keys
                    k_hat = torch.cat([k[:, :, :n], k_hat[:, :, n:]], 2)
                return k_hat, fake_quant(v, vb)

            for ids, logp_ref, _ in refs:
                logp = forward(model, ids, hook)[:, :-1].log_softmax(-1)
                kls.append((logp_ref.exp() * (logp_ref - logp)).sum(-1).mean().item())
                nlls.append(-logp.gather(-1, ids[:, 1:, None]).mean().item())
            out[name] = {"kl": float(np.mean(kls)), "ppl_delta_pct": 100 * (math.exp(np.mean(nlls) - ref_nll) - 1),
                         "bytes_per_token": bytes_per_token(layers, model.config.head_dim),
                         "other_layers": [i for i, c in layers.items() if c != layers_of_base(name)],
                         "seconds": time.perf_counter() - t0}
            log(f"{name:26s} KL {out[name]['kl']:.5f}  PPL {out[name]['ppl_delta_pct']:+.2f}%  "
                f"{out[name]['bytes_per_token']:.1f} B")
    return out


def markdown(doc: dict) -> str:
    r = doc["results"]
    lines = [f"# {doc['model']}: where tq4's error comes from, per-token key centering (CPU, fp32)", "",
             f"{doc['windows']} WikiText-2 windows of {doc['seq_len']} tokens scored, calibration on "
             f"{doc['calib_windows']} others; reference PPL {r['reference']['ppl']:.3f}.", "",
             "| configuration | B/token/KV head | KL (nats/token) | PPL vs fp32 | layers not the base's |",
             "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {n} | {r[n]['bytes_per_token']:.1f} | {r[n]['kl']:.5f} | {r[n]['ppl_delta_pct']:+.2f}% | "
              f"{','.join(map(str, r[n]['other_layers']))} |" for n in r if n != "reference"]
    if doc.get("key_bits_per_layer"):
        rows = doc["key_bits_per_layer"]
        lines += ["", "KL when only one layer is quantized, keys centered per token (k4, k5: values exact; k5v4: "
                  "values 4-bit), one calibration window; the rankings behind topN:", ""]
        lines += [f"- {kind} layers: " + ",".join(map(str, ranked)) for kind, ranked in doc["rankings"].items()]
        cols = [c for c in rows[0] if c != "layer"]
        lines += ["", "| layer | " + " | ".join(cols) + " |", "| ---: |" + " ---: |" * len(cols)]
        lines += [f"| {x['layer']} | " + " | ".join(f"{x[c]:.5f}" for c in cols) + " |" for x in rows]
    lines += ["", "Predicted key-logit error gain over equal bits, per layer and KV head, from the calibration's "
              "x_c = sqrt(E[q_c^2] E[(k_c - m_c)^2]) (ideal: (AM(x) / GM(x))^2, real-valued bits per channel at "
              "the same mean):", "",
              "| key bits by channel | over equal bits | min | median | max | mean |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in doc["predicted_gain"]:
        g = np.array(row["per_layer_head"])
        spec = ",".join(f"{b}x{n}" for b, n in row["groups"]) if row["groups"] else "ideal"
        stats = (g.min(), np.median(g), g.max(), g.mean())
        lines += [f"| {spec} | {row['over_bits'] or 'same mean'} | " + " | ".join(f"{v:.2f}" for v in stats) + " |"]
    variants = [k for k in doc["attention_error"][0] if k != "layer"]
    lines += ["", "Attention output error through o_proj (relative energy), tq4 keys, values exact, one window:", "",
              "| layer | " + " | ".join(variants) + " |", "| ---: |" + " ---: |" * len(variants)]
    lines += [f"| {row['layer']} | " + " | ".join(f"{row[v]:.5f}" for v in variants) + " |"
              for row in doc["attention_error"]]
    mean = {v: np.mean([row[v] for row in doc["attention_error"]]) for v in variants}
    lines += ["| mean | " + " | ".join(f"{mean[v]:.5f}" for v in variants) + " |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(NAME, __doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--wikitext", type=Path, required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--calib-windows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--only", default=";".join(CONFIGS), help="configurations, ';'-separated")
    common.add_out_argument(p, "benchmarks/results/quality_diagnosis/cpu-<model>-centering")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model = load(args.model)
    ids = np.array(AutoTokenizer.from_pretrained(args.model)(args.wikitext.read_text()).input_ids)
    slots = np.random.default_rng(0).permutation(len(ids) // args.seq_len)[:args.windows + args.calib_windows]
    picked = torch.tensor(np.stack([ids[s * args.seq_len:(s + 1) * args.seq_len] for s in slots]))
    windows, calib = picked[:args.windows], picked[args.windows:]
    cal = calibrate(model, calib)
    command = common.command_line(NAME, argv)
    doc = {"command": command, "model": args.model.name, "windows": args.windows, "calib_windows": args.calib_windows,
           "seq_len": args.seq_len, "attention_error": attention_error(model, windows[:1], cal)}
    names, rankings = args.only.split(";"), None
    x = torch.cat([c[2].flatten(0, 2) for c in cal.values()]).double()  # (layers x KV heads, d), layer-major
    groupings = [(None, None)] + list(dict.fromkeys((layers_of_base(n)[0], CONFIGS[n.split("+")[0].strip()][0])
                                                 for n in names if KEY_GROUPS.search(n)))
    doc["predicted_gain"] = [{"groups": g, "over_bits": b, "per_layer_head": predicted_gain(x, g, b).tolist()}
                             for g, b in groupings]
    if any("top" in name for name in names):  # ranked on a calibration window: not the scored ones
        doc["key_bits_per_layer"] = key_bits_per_layer(model, calib[:1], cal)
        rankings = doc["rankings"] = rankings_of(doc["key_bits_per_layer"])
    doc["results"] = kl_and_ppl(model, windows, cal, names, rankings=rankings)
    doc["seconds"] = time.perf_counter() - t0
    meta = common.provenance(command)
    # beside the reference LM's diagnosis: benchmarks/results/quality_diagnosis/cpu-<model>-centering
    default = common.RESULTS / "quality_diagnosis" / f"cpu-{args.model.name}-centering"
    stem = common.stem_of(args.out) if args.out else default
    common.write_json(common.with_ext(stem, ".json"), doc, meta)
    common.write_markdown(common.with_ext(stem, ".md"), markdown(doc), meta)
    print(markdown(doc))
    return doc
