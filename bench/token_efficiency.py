"""Token efficiency: which pretraining configuration gives the lowest validation bits/char for the same wall-clock.

    python bench/token_efficiency.py                         # every config, 2 seeds, the demo's pretrain budget
    python bench/token_efficiency.py --seconds 90 --seeds 0 1 2 --only base muon
    python bench/token_efficiency.py --set pretrain.dtype=fp32   # overrides applied to every config

Each config is params.yaml plus overrides, one change at a time against today's defaults (`base`), then
combinations. Every run trains the pretrain stage (2 torchrun ranks, as the demo) on the demo's corpus
(data/corpus: run `astrai stage corpus` first; each vocabulary size gets its own tokenizer and packed files under
bench/out/) for the same wall-clock budget: its step count comes from a short probe of its speed, so each
config's whole learning-rate schedule fits the budget. Runs are interleaved (for each seed, every config in
turn), so a slow stretch of a shared machine falls on all configs alike. Scored on the validation split (the
test split stays for the final report): bits/char of the final model, and the curve of the held-out loss the
run logged against seconds and tokens. Writes bench/token_efficiency_report.json and its plot
(bench/token_efficiency_report.png).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402
from astrai_core.data.packed import PackedTokens  # noqa: E402
from astrai_core.runtime.io import sha256_file, write_json  # noqa: E402
from astrai_core.scoring.metrics import sequence_nll  # noqa: E402
from astrai_core.scoring.statistics import summarize, unigram_nll  # noqa: E402
from astrai_core.training.distributed import resolve_nproc, run_torchrun  # noqa: E402
from tasks.run.configs import train_config  # noqa: E402
from tasks.run.params import load_params  # noqa: E402
from tasks.stages.pack import pack  # noqa: E402
from tasks.stages.tokenizer import build_tokenizer  # noqa: E402

OUT = ROOT / "bench" / "out"
REPORT = ROOT / "bench" / "token_efficiency_report.json"

# name -> params overrides. One change at a time against base (today's params.yaml), then combinations.
CONFIGS = {
    "base": {},
    "muon": {"pretrain.optim.name": "muon"},
    "muon_lr2x": {"pretrain.optim.name": "muon", "pretrain.optim.muon_lr": 6e-3},
    "muon_lr4x": {"pretrain.optim.name": "muon", "pretrain.optim.muon_lr": 1.2e-2},
    "qk_norm": {"model.qk_norm": True},
    "untied": {"model.tie_embeddings": False},
    "wide192": {"model.dim": 192, "model.n_heads": 6, "model.n_kv_heads": 2},
    "deep6": {"model.n_layers": 6},
    "batch8": {"pretrain.batch_size": 8},
    "compile": {"pretrain.compile": True},  # its first step's compile shows in wall_s, not in train_seconds
    "relu2": {"model.mlp": "relu2"},
    "softcap": {"model.logit_softcap": 15.0},
    "zero_init_out": {"model.zero_init_out": True},
    "value_embeds": {"model.value_embeds": True},
    "x0_scalars": {"model.x0_scalars": True},
    # The combination: the one-at-a-time changes that beat base on both seeds (bench/token_efficiency_report.json,
    # 2026-11-25) and still export exactly (relu2 exports as Arcee, but not beside qk_norm), then the same with
    # Muon's lr doubled again, since 4x was the edge of the sweep, or the batch halved again.
    "combo": {"pretrain.optim.name": "muon", "pretrain.optim.muon_lr": 1.2e-2, "pretrain.batch_size": 8,
              "model.mlp": "relu2"},
    "combo_lr8x": {"pretrain.optim.name": "muon", "pretrain.optim.muon_lr": 2.4e-2, "pretrain.batch_size": 8,
                   "model.mlp": "relu2"},
    "combo_b4": {"pretrain.optim.name": "muon", "pretrain.optim.muon_lr": 1.2e-2, "pretrain.batch_size": 4,
                 "model.mlp": "relu2"},  # and the batch halved again: more, smaller steps
}


def data_for(params, corpus: Path) -> tuple[Path, Path]:
    """The tokenizer and packed splits of this config's vocabulary size (built once, kept under bench/out/)."""
    vocab = params.tokenizer.vocab_size
    tok_dir, packed = OUT / f"tokenizer_{vocab}", OUT / f"packed_{vocab}"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(params.tokenizer, corpus, tok_dir)
    if not (packed / "validation.h5").exists():
        pack(params.pack, corpus, tok_dir / "tokenizer.json", packed)
    return tok_dir / "tokenizer.json", packed


def run(params, packed: Path, tok: Path, out: Path, steps: int, seed: int, eval_every: int) -> dict:
    """Pretrain for `steps` steps under torchrun; the run's summary, its logged curve and its wall seconds."""
    section = params.pretrain.model_copy(update={"max_steps": steps, "seed": seed, "eval_every": eval_every,
                                                 "checkpoint_every": 0, "log_every": max(1, eval_every)})
    if steps <= section.optim.warmup_steps:
        section.optim = section.optim.model_copy(update={"warmup_steps": max(1, steps // 10)})
    cfg = train_config(params.model_copy(update={"pretrain": section}), "pretrain", ROOT).model_copy(update={
        "train_data": str(packed / "train.h5"), "val_data": str(packed / "validation.h5"), "tokenizer": str(tok),
        "out_dir": str(out), "resume": "never"})
    cfg_path = out.with_suffix(".json")
    write_json(cfg_path, cfg.model_dump(mode="json"))
    t0 = time.time()
    run_torchrun(cfg_path, resolve_nproc(params.pretrain.nproc, params.pretrain.device), on_line=lambda _: None)
    summary = json.loads((out / "summary.json").read_text())
    summary["wall"] = time.time() - t0
    summary["curve"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary


def validation_split(packed: Path, tok_path: Path) -> tuple[np.ndarray, int]:
    from tokenizers import Tokenizer

    with PackedTokens(packed / "validation.h5", expected_tokenizer_sha256=sha256_file(tok_path)) as v:
        tokens = np.asarray(v.tokens[:])
    n_chars = len(Tokenizer.from_file(str(tok_path)).decode(tokens[1:].tolist(), skip_special_tokens=True))
    return tokens, n_chars


def val_bpc(ckpt: Path, tokens: np.ndarray, n_chars: int) -> tuple[float, float]:
    """(bits/char of the model, of the unigram baseline) on the validation split."""
    model, _, cfg = load_model(ckpt)
    nll, n = sequence_nll(model, tokens, cfg.max_seq_len, 16)
    base, _ = unigram_nll(tokens, cfg.vocab_size)
    return summarize(nll, n, n_chars)["bits_per_char"], summarize(base, n, n_chars)["bits_per_char"]


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "sd": round(statistics.stdev(values), 4) if len(values) > 1
            else None, "min": round(min(values), 4), "max": round(max(values), 4), "n": len(values)}


def compare(results: dict) -> dict:
    """Each config against base, seed by seed (the same seed shares the data order): the mean difference in
    bits/char, its spread over seeds, and whether every seed moved the same way by more than base's own spread."""
    base = {r["seed"]: r["val_bpc"] for r in results["base"]}
    base_sd = statistics.stdev(base.values()) if len(base) > 1 else 0.0
    out = {}
    for name, runs in results.items():
        diffs = [r["val_bpc"] - base[r["seed"]] for r in runs if r["seed"] in base]
        if not diffs or name == "base":
            continue
        beyond = all(d < -base_sd for d in diffs) or all(d > base_sd for d in diffs)
        out[name] = {"diff_bpc": spread(diffs), "relative": round(statistics.fmean(diffs) / statistics.fmean(base.values()), 4),
                     "every_seed_beyond_base_spread": beyond}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for i, (name, runs) in enumerate(results.items()):
        for j, r in enumerate(runs):
            points = [(m["step"] * r["seconds_per_step"], m["val/loss"] * r["bpc_per_nat"]) for m in r["curve"]
                      if "val/loss" in m]
            xs, ys = zip(*points) if points else ((), ())
            ax.plot(xs, ys, styles[i % 4], color=f"C{i % 10}", alpha=0.8, label=name if j == 0 else None)
            ax.plot([r["train_seconds"]], [r["val_bpc"]], "o", color=f"C{i % 10}")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("validation bits/char (curve: logged held-out batches; dot: whole split)")
    ax.set_title("Pretraining at equal wall-clock, each seed a line")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=None,
                    help="training budget per run (default: what the demo's pretrain steps take here)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--only", nargs="*", default=None, help="config names (base is always run)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE for every config")
    ap.add_argument("--eval-every", type=int, default=20, help="steps between logged held-out losses (the curve)")
    ap.add_argument("--report", type=Path, default=REPORT, help="where the report goes (its plot beside it, .png)")
    args = ap.parse_args()
    import yaml

    common = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.overrides)}
    names = [n for n in CONFIGS if n == "base" or not args.only or n in args.only]
    corpus = ROOT / "data" / "corpus"
    plans = {}
    for name in names:  # data, and the steps that fill the budget at this config's measured speed
        params = load_params(ROOT / "params.yaml", {**common, **CONFIGS[name]})
        tok, packed = data_for(params, corpus)
        probe = run(params, packed, tok, OUT / f"{name}_probe", 12, 0, 0)
        per_step = probe["wall"] / 12  # includes start-up: an upper bound, trimmed by the budget below
        tokens_per_step = params.pretrain.batch_size * params.pretrain.seq_len * params.pretrain.grad_accum * probe["world_size"]
        plans[name] = {"params": params, "tok": tok, "packed": packed, "tokens_per_step": tokens_per_step,
                       "rate": probe["tokens_per_sec"], "probe_wall": probe["wall"]}
    budget = args.seconds or plans["base"]["params"].pretrain.max_steps * plans["base"]["tokens_per_step"] / plans["base"]["rate"]
    results: dict[str, list] = {n: [] for n in names}
    for seed in args.seeds:  # interleaved: every config once per seed, in turn
        for name in names:
            p = plans[name]
            steps = max(20, int(budget * p["rate"] / p["tokens_per_step"]))
            s = run(p["params"], p["packed"], p["tok"], OUT / f"{name}_s{seed}", steps, seed, args.eval_every)
            tokens, n_chars = validation_split(p["packed"], p["tok"])
            bpc, unigram = val_bpc(OUT / f"{name}_s{seed}", tokens, n_chars)
            train_seconds = steps * p["tokens_per_step"] / s["tokens_per_sec"]
            r = {"seed": seed, "steps": steps, "tokens": steps * p["tokens_per_step"], "n_params": s["n_params"],
                 "tokens_per_sec": round(s["tokens_per_sec"]), "train_seconds": round(train_seconds, 1),
                 "wall_s": round(s["wall"], 1), "val_bpc": round(bpc, 4), "unigram_bpc": round(unigram, 4),
                 "seconds_per_step": train_seconds / steps, "bpc_per_nat": (len(tokens) - 1) / n_chars / math.log(2),
                 "curve": [{k: m[k] for k in ("step", "val/loss") if k in m} for m in s["curve"] if "val/loss" in m]}
            results[name].append(r)
            print(json.dumps({"config": name, **{k: v for k, v in r.items() if k != "curve"}}), flush=True)
    report = {
        "how": f"python bench/token_efficiency.py {' '.join(sys.argv[1:])}".strip(),
        "budget_seconds": round(budget, 1), "seeds": args.seeds, "common_overrides": common,
        "configs": {n: CONFIGS[n] for n in names},
        "summary": {n: {"val_bpc": spread([r["val_bpc"] for r in rs]),
                        "tokens_per_sec": spread([r["tokens_per_sec"] for r in rs]),
                        "tokens": spread([r["tokens"] for r in rs])} for n, rs in results.items()},
        "against_base": compare(results),
        "runs": results,
    }
    write_json(args.report, report)
    plot(results, args.report.with_suffix(".png"))
    print(json.dumps(report["against_base"], indent=1))


if __name__ == "__main__":
    main()
