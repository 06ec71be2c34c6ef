"""Serving throughput and latency of `astrai serve` under load, beside the engine alone and a peer server.

    python bench/serving.py --model data/pretrain --peer-venv /work/bench-venv   # the report in README.md
    python bench/serving.py --quick                                              # a smoke run (random weights)
    python bench/serving.py --llama-cpp ~/.cache/astrai/llama.cpp-0.3.36/bin --out bench/serving_llama_cpp_report.json

What is measured, in one run on one machine, each server alone (started fresh in every round; the rounds
interleave the servers, and every figure is the median over --rounds):

* streams: the official `openai` client (AsyncOpenAI, a new connection per request) keeps c streaming
  /v1/completions requests in flight, for c in --levels; --requests per level (at least 2c); prompts of one to four
  consecutive lines of the corpus (--corpus; random words without one); --max-tokens new tokens, greedy. A request
  may end early at the model's end-of-text: output tokens are counted from each response's usage.
* random: a serving benchmark's workload (as `vllm bench serve --dataset-name random`): prompts of random words
  with --random-input tokens (a uniform range) and max_tokens drawn from --random-output, all requests sent at once
  ("burst") and with Poisson arrivals at each of --rates requests/s.
* per workload: output tokens/s (all requests' tokens over the wall time from the first send to the last reply),
  time to first token (TTFT: sent -> first streamed text), time per output token (TPOT: per request, (last text -
  first text) / (tokens - 1)) and inter-token latency (ITL: every gap between two streamed pieces, all requests
  pooled), each at p50 and p99.
* engine: the same streams workload through astrai_core.inference.engine.Engine in this process (no HTTP: step() called in a
  loop, a finished request replaced at once so that c stay in flight), with the torch threads the server picked
  (its /metrics) and with all cores, in every round after the servers: what the HTTP path could at most deliver.
* peer (--peer-venv VENV): the same model exported with `astrai export-hf`, served by `transformers serve
  --continuous-batching` from VENV (a separate venv with transformers[serving], not a project dependency), with
  its defaults and with OMP_NUM_THREADS=1; the same prompts, as text. On failure the report says why.
* llama.cpp (--llama-cpp BIN, the bin/ of scripts/build_llama_cpp.sh): the same model exported with `astrai
  export-gguf` as f32 (the checkpoint's numbers), and as bf16 with --llama-types f32 bf16 (the weights `astrai
  serve` computes with where its --dtype auto picks bf16: the start-up line in the report says which), served by
  `llama-server` with continuous batching and --parallel set to each workload's streams (so every stream has a slot
  of the model's whole context; the burst and Poisson loads get the highest level's), with -t 1 and with -t 2 (its
  threads for generation and for prompts); the same prompts, as text. A server per workload, in each round.
* shared prefix: prompts that all start with the same half-context prefix, 4 streams, on a server with the prefix
  cache and on one without (--no-prefix-cache): time to first token of each, and their ratio.

`astrai serve` runs as shipped (no flags, no OMP_NUM_THREADS): its own thread and batch choices are what is
measured. The default model is the demo's shape (params.yaml's `model` section) with random weights and a
tokenizer of its vocabulary size trained here; --model gives a real checkpoint (a random model rarely emits its
end-of-text, a trained one does). The report records the machine and its load average: anything else running on
the shared cores skews every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint.model_dir import inference_dtype_of, load_model, save_checkpoint  # noqa: E402
from astrai_core.inference.engine import Engine, SamplingParams  # noqa: E402
from astrai_core.model.transformer import Transformer  # noqa: E402
from astrai_core.tokenizer.bpe import train_tokenizer  # noqa: E402
from tasks.run.params import load_params  # noqa: E402

WORDS = ("the king queen lord lady fool ghost speaks loves follows betrays crown horse night brother people "
         "sword castle rain sun and to of in my your thou art hath doth what light yonder window breaks").split()
LATENCIES = ("ttft", "tpot", "itl")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_at_start": os.getloadavg()}


def demo_shape_checkpoint(root: Path) -> Path:
    cfg = load_params(ROOT / "params.yaml").model
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(3000)]
    tok = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    tok.save(str(root / "tokenizer.json"))
    torch.manual_seed(0)
    return save_checkpoint(root / "bench-model", Transformer(cfg), cfg, root / "tokenizer.json")


# --- workloads: (prompt text, max_tokens) per request ---------------------------------------------------------

def stream_prompts(corpus: Path | None, n: int, max_tokens: int, seed: int) -> list[tuple[str, int]]:
    """One to four consecutive non-empty lines of the corpus's first split file (random words without one)."""
    rng = random.Random(seed)
    if corpus is None:
        return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))), max_tokens) for _ in range(n)]
    lines = [line for doc in (json.loads(d) for d in (corpus / "test.jsonl").read_text().splitlines())
             for line in doc["text"].splitlines() if line.strip()]
    out = []
    for _ in range(n):
        i = rng.randrange(len(lines) - 4)
        out.append(("\n".join(lines[i:i + rng.randint(1, 4)]) + "\n", max_tokens))
    return out


def random_prompts(tokenizer, n: int, inputs: tuple[int, int], outputs: tuple[int, int], seed: int
                   ) -> list[tuple[str, int]]:
    """Random words cut to a uniform number of tokens in `inputs`, max_tokens uniform in `outputs`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(4 * inputs[1])),
                               add_special_tokens=False).ids[:rng.randint(*inputs)]
        out.append((tokenizer.decode(ids), rng.randint(*outputs)))
    return out


# --- load generation -------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def one_request(client, model_id: str, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    times, tokens = [], 0
    stream = await client.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return {"sent": sent, "times": times, "tokens": tokens or len(times), "end": time.perf_counter()}


async def run_load(url: str, model_id: str, requests: list[tuple[str, int]], concurrency: int | None = None,
                   rate: float | None = None, seed: int = 0) -> dict:
    """Send `requests`: `concurrency` in flight at a time, or each at its Poisson arrival time at `rate` per
    second, or (neither) all at once. -> throughput and latency percentiles."""
    # A new connection per request (none kept alive): llama-server closes a kept-alive connection after a while,
    # and a request the client sent on it just then failed with "Server disconnected without sending a response"
    # (httpx), which dropped llama-server from a report's later rounds. Both servers get the same client.
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http)
    gate = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(rate) if rate else 0.0

    async def send(i: int, prompt: str, max_tokens: int) -> dict:
        await asyncio.sleep(arrivals[i] - (time.perf_counter() - start))
        async with gate:
            return await one_request(client, model_id, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(send(i, p, m) for i, (p, m) in enumerate(requests)))
    await client.close()
    wall = max(r["end"] for r in results) - start
    lat = {"ttft": [r["times"][0] - r["sent"] for r in results if r["times"]],
           "tpot": [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in results
                    if len(r["times"]) > 1 and r["tokens"] > 1],
           "itl": [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]}
    tokens = sum(r["tokens"] for r in results)
    row = {"requests": len(requests), "output_tokens": tokens, "wall_s": round(wall, 3),
           "output_tokens_per_s": round(tokens / wall, 1)}
    for name in LATENCIES:
        for q in (50, 99):
            v = percentile(lat[name], q)
            row[f"{name}_p{q}_ms"] = None if v is None else round(1000 * v, 2)
    return row


def median_rows(rows: list[dict]) -> dict:
    """Each figure's median over the rounds, with every round's tokens/s."""
    out = {k: statistics.median(r[k] for r in rows) if isinstance(rows[0][k], (int, float)) else rows[0][k]
           for k in rows[0]}
    out["rounds_tokens_per_s"] = [r["output_tokens_per_s"] for r in rows]
    return out


# --- servers ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


class Server:
    """A server subprocess on a free loopback port; `with` starts it, waits until it answers, and stops it."""

    def __init__(self, name: str, command: list[str], env: dict, log: Path, ready: str, cwd: Path = ROOT) -> None:
        self.name, self.command, self.env, self.log_path, self.ready, self.cwd = name, command, env, log, ready, cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*self.command, "--port", str(self.port)], cwd=self.cwd, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        while time.monotonic() < start + 600:  # astrai serve --compile-first compiles before it answers
            try:
                answer = httpx.get(f"{self.url}{self.ready}", timeout=1)
                answer.raise_for_status()
                self.start_up_s = round(time.monotonic() - start, 1)  # launch to first answer
                return self
            except (httpx.TransportError, httpx.HTTPStatusError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                       f"{self.log_path.read_text()[-2000:]}")
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"{self.name} did not start in 10 minutes")

    def peak_rss_mib(self) -> float:
        """The most resident memory the server's process and its children (astrai's engine) have held."""
        ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        total = 0
        for pid in [self.proc.pid, *map(int, ps.stdout.split())]:
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
        return round(total / 1024, 1)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def astrai_server(ckpt: Path, tmp: Path, options: tuple[str, ...] = ()) -> Server:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as shipped: its own thread choice
    return Server("astrai serve", [sys.executable, "-m", "astrai.cli", "serve", "--model", str(ckpt), *options],
                  {**env, "PYTHONPATH": str(ROOT)}, tmp / "astrai.log", "/v1/models")


def peer_server(venv: Path, hf: Path, tmp: Path, threads: int | None) -> Server:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return Server("transformers serve", [str(venv / "bin" / "transformers"), "serve", str(hf),
                                         "--continuous-batching", "--host", "127.0.0.1"],
                  {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}, tmp / "peer.log", "/health", cwd=tmp)


def llama_server(bin_dir: Path, gguf: Path, context: int, tmp: Path, threads: int, parallel: int) -> Server:
    """llama.cpp's server on the GGUF file: `parallel` slots of `context` tokens each, continuous batching."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return Server("llama-server", [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                                   "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
                                   "-c", str(parallel * context), "--cont-batching", "--no-webui", "-a", "astrai"],
                  env, tmp / f"llama-server-{threads}.log", "/health", cwd=tmp)


def measure(server: Server, model_id: str, workloads: dict[str, dict]) -> dict[str, dict]:
    """Every workload once on a running server (after a short warm-up): name -> row."""
    warm = [("the king", 4), ("what light", 4)]
    asyncio.run(run_load(server.url, model_id, warm, concurrency=2))
    out = {}
    for name, w in workloads.items():
        out[name] = asyncio.run(run_load(server.url, model_id, w["requests"], w.get("concurrency"), w.get("rate"),
                                         seed=w.get("seed", 0)))
        print(f"  {server.name} {name}: {out[name]['output_tokens_per_s']} tokens/s, TTFT p50/p99 "
              f"{out[name]['ttft_p50_ms']}/{out[name]['ttft_p99_ms']} ms", flush=True)
    return out


# --- the engine alone ------------------------------------------------------------------------------------------

def engine_alone(model, tokenizer, requests: list[tuple[str, int]], concurrency: int, threads: int) -> dict:
    """The streams workload through an in-process Engine (its default config, as `astrai serve` builds it), c in
    flight: step() in a loop on this thread, a finished request replaced by the next at once."""
    torch.set_num_threads(threads)
    engine = Engine(model)
    prompts = [(tokenizer.encode(p, add_special_tokens=False).ids, m) for p, m in requests]
    queue, tokens, in_flight = list(reversed(prompts)), 0, 0

    def submit_next() -> None:
        nonlocal in_flight
        ids, m = queue.pop()
        engine.submit(ids, SamplingParams(max_tokens=m, temperature=0), on_event)
        in_flight += 1

    def on_event(ids: list[int], finish: str | None) -> None:
        nonlocal tokens, in_flight
        tokens += len(ids) + (finish == "stop")
        if finish is not None:
            in_flight -= 1
            if queue:
                submit_next()

    for _ in range(min(concurrency, len(queue))):
        submit_next()
    engine.step()  # the first step outside the clock: first-call allocations, as the server's warm-up does
    start = time.perf_counter()
    while in_flight or queue:
        engine.step()
    wall = time.perf_counter() - start
    return {"threads": threads, "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1)}


# --- the shared prefix scenario ----------------------------------------------------------------------------------

def shared_prefix(ckpt: Path, tokenizer, context: int, tmp: Path, rounds: int) -> dict:
    """Time to first token when every prompt starts with the same half-context prefix (a long shared system
    prompt), with the prefix cache and without (--no-prefix-cache): a fresh server each."""
    header = random_prompts(tokenizer, 1, (context // 2, context // 2), (8, 8), seed=1000)[0][0]
    requests = [(header + tail, 8) for tail, _ in random_prompts(tokenizer, 16, (8, 24), (8, 8), seed=1001)]
    out = {"prefix_tokens": context // 2, "requests": len(requests), "concurrency": 4, "max_tokens": 8}
    for name, options in (("prefix_cache", ()), ("no_prefix_cache", ("--no-prefix-cache",))):
        with astrai_server(ckpt, tmp, options) as server:
            model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            row = median_rows([measure(server, model_id, {"prefix": {"requests": requests, "concurrency": 4}})
                               ["prefix"] for _ in range(rounds)])
            m = metrics(server.url)
        out[name] = {k: row[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")}
        out[name]["prefix_cache_hit_rate"] = round(m["astrai_prefix_cache_hits_total"]
                                                   / max(1, m["astrai_prefix_cache_queries_total"]), 3)
    out["ttft_p50_ratio_without_over_with"] = round(out["no_prefix_cache"]["ttft_p50_ms"]
                                                    / out["prefix_cache"]["ttft_p50_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: random weights at the demo shape)")
    ap.add_argument("--corpus", type=Path, help="the corpus folder (data/corpus) for the streams prompts "
                                                "(default: random words)")
    ap.add_argument("--quick", action="store_true", help="levels 1 4 16, fewer requests, one round (unless "
                    "--rounds), no random load")
    ap.add_argument("--levels", type=int, nargs="*", help="concurrent streams (default 1 2 4 8 16 64)")
    ap.add_argument("--requests", type=int, default=32, help="streams requests per level (at least 2 x streams)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--random-input", type=int, nargs=2, default=(32, 128), help="random load: prompt tokens, a range")
    ap.add_argument("--random-output", type=int, nargs=2, default=(32, 128), help="random load: max_tokens, a range")
    ap.add_argument("--random-requests", type=int, default=64)
    ap.add_argument("--rates", type=float, nargs="*", default=(8.0, 16.0, 32.0), help="Poisson arrivals, requests/s")
    ap.add_argument("--rounds", type=int, help="rounds of every server; medians are reported (default 3, --quick 1)")
    ap.add_argument("--peer-venv", type=Path, help="a venv with transformers[serving]: also measure `transformers "
                    "serve --continuous-batching` on the same model (exported with astrai export-hf)")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's bin/ (scripts/build_llama_cpp.sh): also measure "
                    "`llama-server` on the same model exported with astrai export-gguf (--llama-types), with each of "
                    "--llama-threads")
    ap.add_argument("--llama-threads", type=int, nargs="*", default=(1, 2), help="llama-server's -t (and -tb) settings")
    ap.add_argument("--llama-types", nargs="*", default=("f32",), choices=("f32", "bf16", "q8_0"), help="the GGUF "
                    "types llama-server runs (astrai export-gguf --type), each as a server of its own (f32's named "
                    "llama_server_T_threads, the others with _TYPE after it)")
    ap.add_argument("--compile", action="store_true", help="also measure `astrai serve --compile-first` (decode steps "
                    "and prefill chunks as torch.compile'd graphs from the first request: the default server once its "
                    "background compile is done), as the server astrai_compile; the server astrai is --no-compile")
    ap.add_argument("--astrai-threads", type=int, nargs="*", default=(), help="also measure `astrai serve --threads N` "
                    "for each N (--no-compile, or --compile-first with --compile), as the server astrai_N_threads (the "
                    "servers astrai and astrai_compile take --threads auto)")
    ap.add_argument("--astrai-dtypes", nargs="*", default=(), choices=("fp32", "bf16"), help="also measure `astrai "
                    "serve --no-compile --dtype D` for each D, as the server astrai_D (the server astrai takes --dtype "
                    "auto)")
    ap.add_argument("--unpacked", action="store_true", help="also measure the server without prepacked weights "
                    "(`--no-pack-weights`; compiled first with --compile), as the server astrai_unpacked")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine alone (its ratios are then missing)")
    ap.add_argument("--no-prefix-scenario", action="store_true", help="skip the shared-prefix TTFT comparison")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "serving_report.json")
    args = ap.parse_args()
    if args.quick:
        args.levels, args.requests, args.rates = args.levels or [1, 4, 16], 8, ()
    args.rounds = args.rounds or (1 if args.quick else 3)
    levels = args.levels or [1, 2, 4, 8, 16, 64]
    report = {"machine": machine(), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                                if k != "out"}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = args.model or demo_shape_checkpoint(tmp)
        # the engine alone computes in the dtype `astrai serve` picks (--dtype auto)
        model, tokenizer, cfg = load_model(ckpt, dtype=inference_dtype_of(ckpt, "auto", torch.device("cpu"))[0])
        report["model"] = {"checkpoint": str(args.model or "random weights, demo shape"), **cfg.model_dump(
            include={"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "mlp"}),
            "parameters": sum(p.numel() for p in model.parameters())}
        workloads = {f"streams_{c}": {"requests": stream_prompts(args.corpus, max(args.requests, 2 * c),
                                                                 args.max_tokens, seed=c), "concurrency": c}
                     for c in levels}
        if not args.quick:
            rand = random_prompts(tokenizer, args.random_requests, tuple(args.random_input), tuple(args.random_output),
                                  seed=7)
            workloads["random_burst"] = {"requests": rand}
            workloads.update({f"random_poisson_{r:g}": {"requests": rand, "rate": r, "seed": i}
                              for i, r in enumerate(args.rates)})

        servers = {"astrai": lambda: astrai_server(ckpt, tmp, ("--no-compile",))}
        for n in args.astrai_threads:  # bind n now, not when the lambda runs
            compiled = "--compile-first" if args.compile else "--no-compile"
            servers[f"astrai_{n}_threads"] = partial(astrai_server, ckpt, tmp, (compiled, "--threads", str(n)))
        for d in args.astrai_dtypes:
            servers[f"astrai_{d}"] = partial(astrai_server, ckpt, tmp, ("--no-compile", "--dtype", d))
        if args.compile:  # the steps compiled before it answers: the default server once its background compile ends
            servers["astrai_compile"] = lambda: astrai_server(ckpt, tmp, ("--compile-first",))
        if args.unpacked:
            servers["astrai_unpacked"] = partial(astrai_server, ckpt, tmp, ("--compile-first" if args.compile else
                                                                            "--no-compile", "--no-pack-weights"))
        if args.peer_venv:
            hf = tmp / "hf-export"
            subprocess.run([sys.executable, "-m", "astrai.cli", "export-hf", str(ckpt), str(hf)], cwd=ROOT, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
            servers["peer_default"] = lambda: peer_server(args.peer_venv, hf, tmp, None)
            servers["peer_1_thread"] = lambda: peer_server(args.peer_venv, hf, tmp, 1)
        # llama-server: one server per workload (its --parallel is the workload's streams).
        per_workload: dict[str, partial] = {}
        if args.llama_cpp:
            for gguf_type in args.llama_types:
                gguf = tmp / f"model-{gguf_type}.gguf"
                subprocess.run([sys.executable, "-m", "astrai.cli", "export-gguf", str(ckpt), str(gguf), "--type",
                                gguf_type], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL)
                for t in args.llama_threads:
                    name = f"llama_server_{t}_thread{'s' * (t > 1)}" + ("" if gguf_type == "f32" else f"_{gguf_type}")
                    per_workload[name] = partial(llama_server, args.llama_cpp, gguf, cfg.max_seq_len, tmp, t)
        rows: dict[str, list[dict]] = {name: [] for name in [*servers, *per_workload]}
        errors: dict[str, str] = {}
        retries: dict[str, list[str]] = {}  # llama-server workloads run again after a dropped connection
        peak_rss: dict[str, list[float]] = {}
        engine_rows: dict[str, dict[str, list[dict]]] = {}
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            for name, make in servers.items():
                if name in errors:
                    continue
                try:
                    with make() as server:
                        model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
                        if name.startswith("astrai"):
                            report.setdefault("start_up_s", {}).setdefault(name, []).append(server.start_up_s)
                        if name == "astrai":
                            m = metrics(server.url)
                            report["astrai_serve"] = {"torch_threads": int(m["astrai_torch_threads"]),
                                                      "start_up": server.log_path.read_text().splitlines()[0]}
                        rows[name].append(measure(server, model_id, workloads))
                        peak_rss.setdefault(name, []).append(server.peak_rss_mib())
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, ours is fatal
                    if name.startswith("astrai"):
                        raise
                    errors[name] = f"{type(e).__name__}: {e}"[-2000:]
                    print(f"  {name} failed: {errors[name]}", flush=True)
            for name, make in per_workload.items():
                if name in errors:
                    continue
                try:
                    row = {}
                    for w, spec in workloads.items():
                        for attempt in (1, 2):  # a fresh server once more if it drops a connection
                            try:
                                with make(spec.get("concurrency") or max(levels)) as server:
                                    row |= measure(server, "astrai", {w: spec})
                                break
                            except openai.APIConnectionError as e:
                                print(f"  {name} {w}: {e} (attempt {attempt})", flush=True)
                                retries.setdefault(name, []).append(w)
                                if attempt == 2:
                                    raise
                    rows[name].append(row)
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported
                    errors[name] = f"{type(e).__name__}: {e}"[-2000:]
                    print(f"  {name} failed: {errors[name]}", flush=True)
            # The engine alone in the same round (the machine's speed drifts between rounds): with the server's
            # threads and with all cores.
            for n_threads in [] if args.no_engine else sorted({report["astrai_serve"]["torch_threads"],
                                                                os.cpu_count() or 1}):
                runs = engine_rows.setdefault(f"{n_threads}_threads", {})
                for c in levels:
                    row = engine_alone(model, tokenizer, workloads[f"streams_{c}"]["requests"], c, n_threads)
                    runs.setdefault(f"streams_{c}", []).append(row)
                print(f"  engine alone, {n_threads} threads:", {c: r[-1]["output_tokens_per_s"]
                                                                for c, r in runs.items()}, flush=True)
        report["servers"] = {name: {w: median_rows([rnd[w] for rnd in runs]) for w in workloads}
                             for name, runs in rows.items() if runs}
        report["errors"] = errors
        report["retries"] = retries
        report["peak_rss_mib"] = peak_rss

        threads = report["astrai_serve"]["torch_threads"]
        report["engine"] = {t: {w: median_rows(runs) for w, runs in by_level.items()} for t, by_level in engine_rows.items()}
        if not args.no_prefix_scenario:
            report["shared_prefix"] = shared_prefix(ckpt, tokenizer, cfg.max_seq_len, tmp, args.rounds)

    ours_named = [("ratios", "astrai"), ("ratios_compile", "astrai_compile"), ("ratios_unpacked", "astrai_unpacked"),
                  *((f"ratios_{n}_threads", f"astrai_{n}_threads") for n in args.astrai_threads),
                  *((f"ratios_{d}", f"astrai_{d}") for d in args.astrai_dtypes)]
    for key, name in ours_named:
        if name not in report["servers"]:
            continue
        ours, report[key] = report["servers"][name], {}
        for c in levels:
            w = f"streams_{c}"
            ratio = {} if args.no_engine else {"of_engine_same_threads": round(
                ours[w]["output_tokens_per_s"] / report["engine"][f"{threads}_threads"][w]["output_tokens_per_s"], 2)}
            for peer in ("peer_default", "peer_1_thread", *per_workload):
                if peer in report["servers"]:
                    ratio[f"over_{peer}"] = round(ours[w]["output_tokens_per_s"] /
                                                  report["servers"][peer][w]["output_tokens_per_s"], 2)
            report[key][w] = ratio
    report["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k, _ in ours_named if k in report}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
