"""Training throughput and model FLOP utilization, side by side with Hugging Face's LlamaForCausalLM.

    python bench/throughput.py                      # everything; writes bench/throughput_report.json
    python bench/throughput.py --quick              # fewer repeats and steps: a smoke run
    python bench/throughput.py --shapes large --dtypes fp32 --steps 3 --variants ours_eager_2rank \
        ours_eager_2rank_fsdp ours_eager_2rank_tp ours_eager_4rank_fsdp+tp \
        --out bench/throughput_parallel_report.json                          # the parallel rows only

What is measured, in one run on one machine:

* peak: a large matmul's FLOP/s in fp32 and bf16 with every core (the denominator of MFU);
* ours: the real training loop (astrai_core.training.train.train on synthetic packed tokens, fused AdamW,
  grad clipping), fp32 and bf16 autocast, eager and with torch.compile (kernels cached in .cache/torchinductor,
  so only the first run of a shape compiles; compilation falls in the untimed first step), on 1 rank using every
  core and on
  2 torchrun ranks (DDP, gloo, one core each) with the same global batch; eager only, the same global batch:
  FSDP2 on 2 ranks, tensor parallelism on 2 ranks (parallel tp, tp_size 2) and the 2-D mesh on 4 ranks (fsdp+tp,
  2 x tp 2; on this 2-core machine its ranks share cores, so it measures the overhead, not a speed-up);
* peer: LlamaForCausalLM of the same shape (SDPA attention, tied embeddings), the same batch, dtype policy
  (autocast bf16, fp32 weights), optimizer (AdamW, weight decay on matrices, the same fused setting) and
  gradient clipping, in a plain loop on 1 rank using every core.

tokens/s is the median over --repeats runs, each timing --steps steps after one warm-up step; the repeats go
round-robin over the variants (ours eager/compiled x 1/2 ranks, the peer), so load drift on this shared machine
hits all of them alike instead of whichever ran during it. FLOPs per token
follow nanoGPT: 6N (N = parameters, the tied embedding counted once, as lm_head) + 12 * layers * dim * seq_len
for attention scores and values. MFU = tokens/s * FLOPs per token / peak of the dtype.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.data.packed import PackedWriter  # noqa: E402
from astrai_core.model.config import ModelConfig  # noqa: E402
from astrai_core.runtime.io import sha256_file  # noqa: E402
from astrai_core.training.config import TrainConfig  # noqa: E402
from astrai_core.training.distributed import run_torchrun  # noqa: E402
from tasks.run.params import load_params  # noqa: E402

_DEMO = load_params(ROOT / "params.yaml")
SHAPES = {
    # the demo's model and batch, as params.yaml has them now
    "demo": dict(model=_DEMO.model.model_dump(), seq_len=_DEMO.pretrain.seq_len,
                 batch_size=_DEMO.pretrain.batch_size),
    # the demo's shape until it moved to AVX2-only CPUs (the 2026-11-21 report's "demo" rows)
    "wide": dict(model=dict(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256),
                 seq_len=256, batch_size=16),
    # twice as wide and as deep as "wide", twice the context; batch 4 keeps a step around a second or two
    "large": dict(model=dict(vocab_size=2048, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=512),
                  seq_len=512, batch_size=4),
}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "amx": any(f.startswith("amx") for f in flags),
            "avx512_bf16": "avx512_bf16" in flags, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_at_start": os.getloadavg()}  # anything else running skews every number below


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul with every core (median of reps)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    from astrai_core.model.transformer import Transformer

    with torch.device("meta"):
        n = Transformer(cfg).num_params()
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len


def synthetic_data(root: Path, vocab: int, n_tokens: int = 1 << 20) -> dict:
    tok = root / "tokenizer.json"
    tok.write_text('{"synthetic": true}')
    sha = sha256_file(tok)
    ids = np.random.default_rng(0).integers(0, vocab, n_tokens)
    with PackedWriter(root / "train.h5", vocab_size=vocab, tokenizer_sha256=sha, source_manifest_sha256="0" * 64,
                      split="train") as w:
        w.add_document(ids)
    return {"train": root / "train.h5", "tokenizer": tok}


def ours(shape: str, dtype: str, nproc: int, compile: bool, steps: int, data: dict, root: Path,
         parallel: str = "ddp", tp_size: int = 1) -> float:
    """tokens/s of one training run (the loop's own measurement, the first step excluded)."""
    s = SHAPES[shape]
    batch = s["batch_size"] // (nproc // tp_size)  # the same global batch: a TP group shares one batch
    cfg = TrainConfig(model=s["model"], train_data=str(data["train"]), tokenizer=str(data["tokenizer"]),
                      out_dir=str(root / f"out_{shape}_{dtype}_{nproc}_{parallel}"), seq_len=s["seq_len"],
                      batch_size=batch, max_steps=steps + 1, dtype=dtype, device="cpu", log_every=10**6,
                      eval_every=0, compile=compile, compile_cache_dir=str(ROOT / ".cache" / "torchinductor"),
                      parallel=parallel, tp_size=tp_size)
    if nproc == 1:
        from astrai_core.training.train import train

        return train(cfg)["tokens_per_sec"]
    path = root / "cfg.json"
    path.write_text(cfg.model_dump_json())
    for attempt in (1, 2):  # a rank that dies while the group starts up is retried once, and said
        lines: collections.deque[str] = collections.deque(maxlen=30)
        try:
            run_torchrun(path, nproc, on_line=lines.append, env={"OMP_NUM_THREADS": "1"})
            break
        except RuntimeError as e:
            print(f"{shape}/{dtype}/{nproc} ranks failed (attempt {attempt}): {e}\n" + "\n".join(lines),
                  file=sys.stderr, flush=True)
            if attempt == 2:
                raise
    return json.loads((Path(cfg.out_dir) / "summary.json").read_text())["tokens_per_sec"]


def peer(shape: str, dtype: str, steps: int) -> float:
    """tokens/s of LlamaForCausalLM's training step at the same shape, batch, dtype policy and optimizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s, m = SHAPES[shape], ModelConfig(**SHAPES[shape]["model"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, tie_word_embeddings=True, attn_implementation="sdpa"))
    model.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), fused=True)  # what TrainConfig's optim.fused=auto picks on CPU
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        ids = torch.randint(0, m.vocab_size, (s["batch_size"], s["seq_len"] + 1), generator=gen)
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return s["batch_size"] * s["seq_len"] * steps / sum(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--variants", nargs="+", default=None,
                        help="only these rows (e.g. ours_eager_2rank_tp); default: all. Ratios need both sides")
    parser.add_argument("--out", default=str(ROOT / "bench" / "throughput_report.json"))
    parser.add_argument("--quick", action="store_true", help="1 repeat of 2 steps, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 2
    os.environ.pop("MLFLOW_RUN_ID", None)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)

    report = {"machine": machine(), "method": __doc__.split("What is measured", 1)[1].strip(),
              "repeats": args.repeats, "timed_steps": args.steps, "command": " ".join(sys.argv)}
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peak = {dtype: matmul_peak(torch_dtype[dtype]) for dtype in args.dtypes}  # bf16 is slow without avx512_bf16
    report["matmul_peak_flops"] = peak
    print(json.dumps({"matmul_peak_gflops": {k: v / 1e9 for k, v in peak.items()}}), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            (Path(tmp) / shape).mkdir()
            data = synthetic_data(Path(tmp) / shape, SHAPES[shape]["model"]["vocab_size"])
            fpt = flops_per_token(ModelConfig(**SHAPES[shape]["model"]), SHAPES[shape]["seq_len"])
            for dtype in args.dtypes:
                variants = {f"ours_{'compiled' if c else 'eager'}_{n}rank": (lambda c=c, n=n: ours(
                    shape, dtype, n, c, args.steps, data, Path(tmp))) for c in (False, True) for n in (1, 2)}
                variants["ours_eager_2rank_fsdp"] = lambda: ours(shape, dtype, 2, False, args.steps, data, Path(tmp),
                                                                 parallel="fsdp")
                for name, nproc, parallel in (("ours_eager_2rank_tp", 2, "tp"),
                                              ("ours_eager_4rank_fsdp+tp", 4, "fsdp+tp")):
                    variants[name] = lambda n=nproc, p=parallel: ours(shape, dtype, n, False, args.steps, data,
                                                                      Path(tmp), parallel=p, tp_size=2)
                variants["hf_llama_1rank"] = lambda: peer(shape, dtype, args.steps)
                if args.variants:
                    variants = {name: variants[name] for name in args.variants}
                runs = {name: [] for name in variants}
                for _ in range(args.repeats):  # round-robin: a load change hits every variant, not one
                    for name, run in variants.items():
                        runs[name].append(run())
                row = {"shape": shape, **SHAPES[shape], "dtype": dtype, "flops_per_token": fpt}
                for name, values in runs.items():
                    tps = statistics.median(values)
                    row[name] = {"tokens_per_sec": round(tps, 1), "mfu": round(tps * fpt / peak[dtype], 4),
                                 "runs": [round(v, 1) for v in values]}
                tps = {name: row[name]["tokens_per_sec"] for name in runs}
                ratios = {f"ratio_vs_peer_{m}": (f"ours_{m}_1rank", "hf_llama_1rank") for m in ("eager", "compiled")}
                ratios |= {f"ratio_2ranks_vs_1rank_{m}": (f"ours_{m}_2rank", f"ours_{m}_1rank")
                           for m in ("eager", "compiled")}
                ratios |= {"ratio_fsdp_vs_ddp_2ranks_eager": ("ours_eager_2rank_fsdp", "ours_eager_2rank"),
                           "ratio_tp_vs_ddp_2ranks_eager": ("ours_eager_2rank_tp", "ours_eager_2rank"),
                           "ratio_fsdp+tp_4ranks_vs_fsdp_2ranks_eager": ("ours_eager_4rank_fsdp+tp",
                                                                         "ours_eager_2rank_fsdp")}
                for key, (a, b) in ratios.items():  # each against a peer measured in the same run
                    if a in tps and b in tps:
                        row[key] = round(tps[a] / tps[b], 3)
                print(json.dumps(row), flush=True)
                results.append(row)
    report["results"] = results
    report["machine"]["load_average_at_end"] = os.getloadavg()
    report["targets"] = {
        "bf16 >= 1.5x peer": {f'{r["shape"]}/{m}': r[f"ratio_vs_peer_{m}"] for r in results if r["dtype"] == "bf16"
                              for m in ("eager", "compiled") if f"ratio_vs_peer_{m}" in r},
        "fp32 >= 1.0x peer": {f'{r["shape"]}/{m}': r[f"ratio_vs_peer_{m}"] for r in results if r["dtype"] == "fp32"
                              for m in ("eager", "compiled") if f"ratio_vs_peer_{m}" in r},
        "2 ranks >= 0.9x 1 rank": {f'{r["shape"]}/{r["dtype"]}/{m}': r[f"ratio_2ranks_vs_1rank_{m}"] for r in results
                                   for m in ("eager", "compiled") if f"ratio_2ranks_vs_1rank_{m}" in r},
    }
    print(json.dumps(report["targets"], indent=2))
    if not args.quick:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
