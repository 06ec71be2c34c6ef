"""The GPU path measured in one run on one GPU: writes bench/gpu_report.json (issue 44).

    python bench/gpu.py            # on a GPU machine, no arguments, about 5 minutes
    python bench/gpu.py --smoke    # tiny shapes on whatever device is here: checks the script (tests/test_gpu_bench.py)

It imports only torch, transformers, numpy, h5py, safetensors, tokenizers, jinja2 and pydantic (through astrai_core):
a lent GPU machine has torch and no Prefect, MLflow or package index. Each section is written to the report as
soon as it is done, so a run cut short keeps what it measured.

* peak: a bf16 8192^3 matmul's FLOP/s (the denominator of MFU);
* training, at the demo's shape and a GPT-2-small-like one (vocab 32,768, dim 768, 12 layers, 12/4 heads, seq 1,024,
  batch 16): astrai_core.training.train.train eager and compiled, against Hugging Face's LlamaForCausalLM of the same
  shape (SDPA, tied embeddings, SwiGLU: both models use ModelConfig's default MLP here) eager and torch.compile'd in a
  plain loop, bf16 autocast and fused AdamW for all; two rounds, the variants interleaved, medians. MFU =
  tokens/s x (6N + 12 L d T) / peak (nanoGPT's count);
* distributed: torchrun (nccl on a GPU) run twice (bitwise equal?) and stopped by SIGTERM after a checkpoint then
  rerun (bitwise equal to the uninterrupted run?);
* engine: tokens/s at 1, 16 and 64 streams of 128 new tokens, time to first token, at the demo's shape and a
  100M one, and greedy equality with generate() (fp32 weights, random: the speed does not depend on them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.data.packed import PackedWriter  # noqa: E402
from astrai_core.model.config import ModelConfig  # noqa: E402
from astrai_core.runtime.io import sha256_file  # noqa: E402
from astrai_core.training.config import TrainConfig  # noqa: E402

DEMO = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)  # params.yaml's model
GPT2 = dict(vocab_size=32768, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, max_seq_len=1024)
TINY = dict(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
FULL = {
    "train": {"demo": dict(model=DEMO, seq_len=256, batch_size=8), "gpt2_small": dict(model=GPT2, seq_len=1024,
                                                                                      batch_size=16)},
    "steps": 20, "rounds": 2, "matmul": 8192,
    "engine": {"demo": DEMO, "100m": GPT2}, "streams": (1, 16, 64), "new_tokens": 128,
}
SMOKE = {
    "train": {"tiny": dict(model=TINY, seq_len=64, batch_size=4)}, "steps": 2, "rounds": 1, "matmul": 1024,
    "engine": {"tiny": TINY}, "streams": (1, 4), "new_tokens": 8,
}


def write(report: dict, out: Path) -> None:
    out.write_text(json.dumps(report, indent=1) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(n: int, device: torch.device, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def flops_per_token(model: dict, seq_len: int) -> float:
    from astrai_core.model.transformer import Transformer

    with torch.device("meta"):
        n = Transformer(ModelConfig(**model)).num_params()
    return 6 * n + 12 * model["n_layers"] * model["dim"] * seq_len


def synthetic_data(root: Path, vocab: int, n_tokens: int) -> dict:
    tok = root / "tokenizer.json"
    tok.write_text('{"synthetic": true}')
    ids = np.random.default_rng(0).integers(0, vocab, n_tokens)
    with PackedWriter(root / f"train{vocab}.h5", vocab_size=vocab, tokenizer_sha256=sha256_file(tok),
                      source_manifest_sha256="0" * 64, split="train") as w:
        w.add_document(ids)
    return {"train": str(root / f"train{vocab}.h5"), "tokenizer": str(tok)}


def train_config(shape: dict, data: dict, out_dir: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(**{
        "model": shape["model"], "train_data": data["train"], "tokenizer": data["tokenizer"], "out_dir": str(out_dir),
        "seq_len": shape["seq_len"], "batch_size": shape["batch_size"], "max_steps": steps, "log_every": 10**6,
        "eval_every": 0, "checkpoint_every": 0, "optim": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 1},
        "compile_cache_dir": str(ROOT / ".cache" / "torchinductor"),
        "dtype": "bf16" if torch.cuda.is_available() else "fp32", **kw})  # autocast as the peer's


def ours(shape: dict, data: dict, root: Path, steps: int, compile: bool) -> float:
    """tokens/s of astrai_core.training.train.train (the loop's own count, its first step excluded)."""
    from astrai_core.training.train import train

    out = root / f"ours_{uuid.uuid4().hex[:8]}"
    return train(train_config(shape, data, out, steps + 1, compile=compile), callbacks=[])["tokens_per_sec"]


class Peer:
    """LlamaForCausalLM of the same shape in a plain loop: bf16 autocast, fused AdamW (weight decay on matrices),
    gradient clipping; built once, so its compiled graph is reused from round to round."""

    def __init__(self, shape: dict, device: torch.device, compile: bool) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        m = ModelConfig(**shape["model"])
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layers,
            num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
            rms_norm_eps=m.norm_eps, tie_word_embeddings=True, attn_implementation="sdpa")).to(device)
        self.forward = torch.compile(self.model) if compile else self.model
        params = list(self.model.parameters())
        self.params = params
        self.opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=3e-4, betas=(0.9, 0.95), fused=True)
        self.shape, self.device, self.vocab = shape, device, m.vocab_size

    def tokens_per_sec(self, steps: int) -> float:
        s, gen = self.shape, torch.Generator(self.device).manual_seed(0)
        bf16 = self.device.type == "cuda"
        timed = 0.0
        for i in range(steps + 1):  # the first step (and its compile) is not timed
            ids = torch.randint(0, self.vocab, (s["batch_size"], s["seq_len"]), generator=gen, device=self.device)
            sync(self.device)
            t0 = time.perf_counter()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = self.forward(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            sync(self.device)
            timed += (time.perf_counter() - t0) if i else 0.0
        return s["batch_size"] * s["seq_len"] * steps / timed


def training(cfg: dict, device: torch.device, peak: float, root: Path) -> dict:
    out = {}
    for name, shape in cfg["train"].items():
        data = synthetic_data(root, shape["model"]["vocab_size"], 1 << 22 if name != "tiny" else 1 << 14)
        peers = {"hf_eager": Peer(shape, device, False), "hf_compiled": Peer(shape, device, True)}
        runs: dict[str, list[float]] = {k: [] for k in ("ours_eager", "ours_compiled", "hf_eager", "hf_compiled")}
        for _ in range(cfg["rounds"]):  # interleaved: drift on the machine hits every variant alike
            runs["ours_eager"].append(ours(shape, data, root, cfg["steps"], compile=False))
            runs["hf_eager"].append(peers["hf_eager"].tokens_per_sec(cfg["steps"]))
            runs["ours_compiled"].append(ours(shape, data, root, cfg["steps"], compile=True))
            runs["hf_compiled"].append(peers["hf_compiled"].tokens_per_sec(cfg["steps"]))
        per_token = flops_per_token(shape["model"], shape["seq_len"])
        out[name] = {k: {"tokens_per_sec": round(statistics.median(v)), "rounds": [round(x) for x in v],
                         "mfu": round(statistics.median(v) * per_token / peak, 4)} for k, v in runs.items()}
        out[name]["ours_compiled_over_hf_compiled"] = round(
            out[name]["ours_compiled"]["tokens_per_sec"] / out[name]["hf_compiled"]["tokens_per_sec"], 3)
        print(name, json.dumps(out[name]), flush=True)
        del peers
    return out


def _weights_sha(out_dir: Path) -> str:
    return hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()


CHILDREN: list[subprocess.Popen] = []  # torchrun groups: ended with the script (a SIGTERM included)


def _torchrun(config: Path, nproc: int) -> subprocess.Popen:
    rdzv = tempfile.mkdtemp(prefix="astrai-rdzv-", dir=config.parent)  # removed with the bench's temporary folder
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}/store", "--rdzv-conf=store_type=file",
           f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1", "-m", "astrai_core.training.train",
           "--config", str(config)]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # packages carried there kept
    CHILDREN.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}))
    return CHILDREN[-1]


def _stop(signum: int, _frame) -> None:
    """SIGTERM (`timeout`, a scheduler): end the torchrun groups, then unwind, so the temporary folder goes too."""
    for proc in CHILDREN:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def distributed(device: torch.device, root: Path) -> dict:
    """torchrun run to run, and SIGTERM after a checkpoint then the same command, against the uninterrupted run."""
    nproc = max(1, torch.cuda.device_count()) if device.type == "cuda" else 1
    shape = dict(model=DEMO, seq_len=128, batch_size=8)
    data = synthetic_data(root, DEMO["vocab_size"], 1 << 18)
    shas, lines = [], []
    for name in ("run_a", "run_b", "stopped"):
        cfg = train_config(shape, data, root / name / "out", 40, checkpoint_every=5 if name == "stopped" else 0,
                           log_every=1, resume="auto")
        path = root / f"{name}.json"
        path.write_text(cfg.model_dump_json())
        proc = _torchrun(path, nproc)
        if name == "stopped":  # the first periodic checkpoint, then SIGTERM to torchrun and its ranks
            for line in proc.stdout:
                lines.append(line.rstrip())
                if line.startswith("checkpoint "):
                    os.killpg(proc.pid, signal.SIGTERM)
                    break
            lines += proc.communicate(timeout=300)[0].splitlines()
            proc = _torchrun(path, nproc)  # the same command again: it resumes
        output = proc.communicate(timeout=600)[0]
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun {name} failed:\n{output[-3000:]}")
        lines += output.splitlines()
        shas.append(_weights_sha(Path(cfg.out_dir)))
    return {"nproc": nproc, "backend": "nccl" if device.type == "cuda" else "gloo",
            "run_to_run_bitwise_equal": shas[0] == shas[1], "resumed_bitwise_equal": shas[2] == shas[0],
            "resumed_from": next((ln for ln in lines if ln.startswith("resuming from")), None),
            "stopped": next((ln for ln in lines if ln.startswith("stopped at step")), None)}


def engine(cfg: dict, device: torch.device) -> dict:
    from astrai_core.inference.engine import Engine, EngineConfig, SamplingParams
    from astrai_core.inference.generate import generate
    from astrai_core.model.transformer import Transformer

    out = {}
    for name, shape in cfg["engine"].items():
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**shape)).to(device).eval()
        rng = np.random.default_rng(0)
        rows = {}
        for streams in cfg["streams"]:
            eng = Engine(model, EngineConfig(max_batch_size=max(cfg["streams"]), max_waiting=1024))
            n_new = cfg["new_tokens"]
            got: list[list[int]] = [[] for _ in range(streams)]
            first: list[float | None] = [None] * streams
            prompts = [rng.integers(0, shape["vocab_size"], 32).tolist() for _ in range(streams)]
            warm = Engine(model, EngineConfig(max_batch_size=4))  # the first CUDA kernels of this shape, untimed
            warm.submit(prompts[0], SamplingParams(max_tokens=4, temperature=0), lambda tokens, reason: None)
            while warm.step():
                pass
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                def on_event(tokens, reason, i=i):
                    if tokens and first[i] is None:
                        first[i] = time.perf_counter()
                    got[i].extend(tokens)
                eng.submit(prompt, SamplingParams(max_tokens=n_new, temperature=0), on_event)
            while eng.step():
                pass
            seconds = time.perf_counter() - t0
            want = [generate(model, p, n_new) for p in prompts[:8]]
            rows[str(streams)] = {"tokens_per_sec": round(sum(map(len, got)) / seconds),
                                  "ttft_ms_median": round(1000 * statistics.median(f - t0 for f in first), 2),
                                  "greedy_equal_to_generate": f"{sum(a == b for a, b in zip(got, want))}/{len(want)}"}
            print(name, streams, rows[str(streams)], flush=True)
        out[name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/gpu_report.json (smoke: none)")
    parser.add_argument("--sections", default="training,distributed,engine", help="the sections to run, in order")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():  # a CPU against a GPU's peak would be a number, not a measure
        sys.exit("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is false): it measures a GPU; "
                 "--smoke checks the script on this machine")
    signal.signal(signal.SIGTERM, _stop)
    cfg = SMOKE if args.smoke else FULL
    out = args.out or (None if args.smoke else ROOT / "bench" / "gpu_report.json")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "smoke": args.smoke,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["peak_flops"] = matmul_peak(cfg["matmul"], device, dtype)
    report["peak_dtype"] = str(dtype)
    with tempfile.TemporaryDirectory(prefix="astrai-gpu-bench-") as tmp:
        sink = out or Path(tmp) / "report.json"  # smoke without --out: printed, not kept
        sections = {"training": lambda: training(cfg, device, report["peak_flops"], Path(tmp)),
                    "distributed": lambda: distributed(device, Path(tmp)), "engine": lambda: engine(cfg, device)}
        for section in args.sections.split(","):
            run = sections[section]
            t0 = time.perf_counter()
            try:
                report[section] = run()
            except Exception as e:  # a device's first run: one section's failure keeps the others' measurements
                traceback.print_exc()
                report[section] = {"error": f"{type(e).__name__}: {e}"}
            report[f"{section}_seconds"] = round(time.perf_counter() - t0, 1)
            write(report, sink)
    print(json.dumps(report, indent=1))
    print(f"wrote {sink}" if out else "--smoke: the report above is not kept (--out FILE keeps it)")
    if failed := [section for section in args.sections.split(",") if "error" in report[section]]:
        sys.exit(f"bench/gpu.py: {', '.join(failed)} failed (the report says why)")


if __name__ == "__main__":
    main()
