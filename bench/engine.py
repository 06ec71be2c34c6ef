"""How far the serving engine's greedy outputs are from generate() on each request alone (not a test).

Runs N mixed requests (prompt lengths 1-48 tokens, a third of them starting with one of a few shared 16-32 token
headers so the prefix cache hits, 4-24 new tokens each) through one Engine (batch 16, prefill chunks of 16, a
pool small enough that preemption happens), then each request alone through astrai_core.inference.generate.generate, and
counts the tokens that differ. The top-2 logit gap at every greedy step of the solo runs shows how many near-ties
the run met. For each request that diverges, the logits generate() saw at the first differing
position (a forward over the prompt and the common tokens) give the top-2 gap: a difference is acceptable only
as a near-tie, where last-bit rounding picks the other token; a wide gap would be a bug. A tiny random model
(weights scaled up so its distributions are about as peaked as a trained model's) on one thread.

    python bench/engine.py [--requests 1000] [--arch default] [--vocab 256] [--batch-invariant] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

from astrai_core.inference.engine import Engine, EngineConfig, SamplingParams
from astrai_core.inference.generate import generate
from astrai_core.model.config import ModelConfig
from astrai_core.model.transformer import Transformer

ARCHS = {
    "default": {},
    "mqa_qk_norm": {"n_kv_heads": 1, "qk_norm": True},
    "gated": {"attn_gate": True, "qkv_bias": True},
    "mla": {"attention": "mla", "mla_kv_rank": 32, "mla_rope_dim": 8},
    "moe": {"n_experts": 4, "n_shared_experts": 1, "moe_top_k": 2},
}
SHAPE = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 96}


def requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    headers = [[rng.randrange(vocab) for _ in range(rng.choice((16, 24, 32)))] for _ in range(4)]
    out = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        if rng.random() < 1 / 3:
            prompt = rng.choice(headers) + prompt[:16]
        out.append((prompt, rng.randint(4, 24)))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--arch", choices=list(ARCHS), default="default")
    ap.add_argument("--scale", type=float, default=2.0, help="weights multiplied by this after the random init")
    ap.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="a larger vocabulary meets more near-ties")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig(batch_invariant=True)")
    ap.add_argument("--kv-blocks", type=int, default=40, help="blocks of 16 tokens (16 full contexts need 96)")
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny model: one thread is fastest, and the machine is shared
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SHAPE, "vocab_size": args.vocab, **ARCHS[args.arch]})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(args.scale)
    reqs = requests(args.requests, args.vocab)

    engine = Engine(model, EngineConfig(max_batch_size=16, block_size=16, kv_blocks=args.kv_blocks, prefill_chunk=16,
                                        max_waiting=len(reqs), batch_invariant=args.batch_invariant))
    got: list[list[int]] = [[] for _ in reqs]
    for i, (prompt, n) in enumerate(reqs):
        engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0),
                      lambda tokens, reason, i=i: got[i].extend(tokens))
    t = time.perf_counter()
    steps = 0
    while engine.step():
        steps += 1
    engine_s = time.perf_counter() - t
    stats = engine.stats()

    t = time.perf_counter()
    want = [generate(model, prompt, n) for prompt, n in reqs]
    solo_s = time.perf_counter() - t

    # How close the calls were: the top-2 gap at every greedy step of the solo runs (one uncached forward each).
    gaps = []
    with torch.no_grad():
        for (prompt, _), b in zip(reqs, want):
            logits = model(torch.tensor([prompt + b[:-1]]))[0, len(prompt) - 1:].float()
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
    gaps = torch.cat(gaps)

    diverged = []
    for i, ((prompt, _), a, b) in enumerate(zip(reqs, got, want)):
        if a == b:
            continue
        j = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + b[:j]]))[0, -1].float()
        top2 = logits.topk(2).values
        diverged.append({"request": i, "position": j, "tokens_differing": sum(x != y for x, y in zip(a, b)),
                         "top2_gap": float(top2[0] - top2[1]),
                         "engine_token_is_runner_up": int(logits.topk(2).indices[1]) == a[j]})
    total = sum(len(b) for b in want)
    report = {
        "machine": f"{cpu_name()}, torch {torch.__version__}, 1 thread",
        "arch": args.arch, "batch_invariant": args.batch_invariant, "requests": len(reqs),
        "tokens": total, "engine_steps": steps, "engine_seconds": round(engine_s, 2),
        "engine_tokens_per_s": round(total / engine_s, 1), "solo_seconds": round(solo_s, 2),
        "solo_tokens_per_s": round(total / solo_s, 1),
        "preemptions": stats["preemptions_total"],
        "prefix_cache_hit_rate": round(stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1), 3),
        "requests_diverging": len(diverged),
        "tokens_differing": sum(d["tokens_differing"] for d in diverged),
        "largest_top2_gap_at_a_divergence": max((d["top2_gap"] for d in diverged), default=None),
        "greedy_steps": len(gaps), "smallest_top2_gap": float(gaps.min()),
        "steps_with_top2_gap_below": {str(t): int((gaps < t).sum()) for t in (1e-3, 1e-4, 1e-5, 1e-6)},
        "divergences": diverged,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "divergences"}, indent=1))
    for d in diverged:
        print(f"  request {d['request']}: first difference at new token {d['position']}, top-2 gap "
              f"{d['top2_gap']:.2e}, engine took the runner-up: {d['engine_token_is_runner_up']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
