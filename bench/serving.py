"""Serving throughput and latency of `astrai serve` under concurrent load, beside one-at-a-time generation.

    python bench/serving.py                          # concurrency 1, 4, 16, 64; writes bench/serving_report.json
    python bench/serving.py --quick                  # concurrency 1, 4, 16 with fewer requests: a smoke run
    python bench/serving.py --model data/grpo        # a real checkpoint instead of the random-weights default

What is measured, in one run on one machine:

* served: a real `astrai serve` subprocess on a free loopback port; an asyncio load generator with the official
  `openai` client (AsyncOpenAI) keeps `c` streaming /v1/completions requests in flight (c = each concurrency
  level), --requests per level, prompts of mixed length (--min-prompt to --max-prompt tokens of random words),
  greedy, max_tokens fixed (a request also ends early if the model emits <|end_of_text|>: output tokens are
  counted from each response's usage). Per level: output tokens/s (all requests' tokens over the level's wall
  time), time to first token p50/p99 (request sent -> first streamed text), inter-token latency p50 (over
  requests, each request's (last text - first text) / (tokens - 1)), and the KV pool's size and the most blocks
  in use (polled from /metrics).
* shared prefix: prompts that all start with the same half-context prefix, at concurrency 4, on a fresh server
  with the prefix cache and on one without (--no-prefix-cache): time to first token of each, and their ratio.
* peer (--peer-venv VENV): the same model exported with `astrai export-hf`, served by `transformers serve
  --continuous-batching` from VENV (a separate venv with transformers[serving], not a project dependency), the same
  levels and prompts (sent as text: its /v1/completions takes no token ids); on failure the report says why.
* naive: the same model in this process, one request at a time through astrai_core.generate.generate (a
  KV-cached loop, batch 1) over the level-1 prompts: what serving without batching gives.

The default model is the demo's shape (params.yaml's `model` section) with random weights and a tokenizer of its
vocabulary size trained here: speed does not depend on the weights. Every level runs --repeats times in a row and
reports the median run's figures (by output tokens/s) with every run's tokens/s. The report records the machine
and its load average, since anything else running on the shared cores skews every number; both sides use
--threads torch threads (default 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint import load_model, save_checkpoint  # noqa: E402
from astrai_core.generate import generate  # noqa: E402
from astrai_core.model import Transformer  # noqa: E402
from astrai_core.bpe import special_id, train_tokenizer  # noqa: E402
from tasks.params import load_params  # noqa: E402

WORDS = ("the king queen lord lady fool ghost speaks loves follows betrays crown horse night brother people "
         "sword castle rain sun and to of in my your thou art hath doth what light yonder window breaks").split()


THREADS = 1  # torch threads of the server and of the naive loop (--threads)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average_at_start": os.getloadavg()}


def demo_shape_checkpoint(root: Path) -> Path:
    cfg = load_params(ROOT / "params.yaml").model
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(3000)]
    tok = train_tokenizer(texts, vocab_size=cfg.vocab_size)
    tok.save(str(root / "tokenizer.json"))
    torch.manual_seed(0)
    return save_checkpoint(root / "bench-model", Transformer(cfg), cfg, root / "tokenizer.json")


def prompts_for(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(4 * hi)), add_special_tokens=False).ids
        out.append(ids[:rng.randint(lo, hi)])
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def one_request(client, model_id: str, prompt: list[int] | str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    times, tokens = [], 0
    stream = await client.completions.create(model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    end = time.perf_counter()
    # inter-token latency of this request: its stream's mean gap per token after the first
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return {"ttft": times[0] - sent if times else None, "tokens": tokens, "latency": end - sent, "itl": itl}


async def load_level(url: str, model_id: str, prompts: list[list[int]] | list[str], concurrency: int, max_tokens: int,
                     kv_metrics: bool = True) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    peak_blocks = 0
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal peak_blocks
        async with httpx.AsyncClient(timeout=10) as http:
            while kv_metrics and not done.is_set():
                text = (await http.get(f"{url}/metrics")).text
                used = next(float(line.split()[1]) for line in text.splitlines()
                            if line.startswith("astrai_kv_blocks_used "))
                peak_blocks = max(peak_blocks, used)
                await asyncio.sleep(0.05)

    async def gated(prompt):
        async with gate:
            return await one_request(client, model_id, prompt, max_tokens)

    poller = asyncio.create_task(poll())
    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    wall = time.perf_counter() - start
    done.set()
    await poller
    await client.close()
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [r["itl"] for r in results if r["itl"] is not None]
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
            "itl_p50_ms": round(1000 * percentile(itls, 50), 2), "kv_blocks_used_peak": int(peak_blocks)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median output tokens/s, with every run's tokens/s."""
    runs = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    return {**runs[len(runs) // 2], "runs_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


def repeated_level(url: str, model_id: str, prompts: list, concurrency: int, max_tokens: int, repeats: int,
                   kv_metrics: bool = True) -> dict:
    """load_level `repeats` times: median_run of them."""
    return median_run([asyncio.run(load_level(url, model_id, prompts, concurrency, max_tokens, kv_metrics))
                       for _ in range(repeats)])


def naive(model, prompts: list[list[int]], max_tokens: int, eos: int) -> dict:
    tokens, ttfts = 0, []
    generate(model, prompts[0], 2)  # warm-up (first-call allocations), as the server gets below
    start = time.perf_counter()
    for p in prompts:
        t0 = time.perf_counter()
        generate(model, p, 1, stop_ids=(eos,))  # prefill + first token: this request's time to first token
        ttfts.append(time.perf_counter() - t0)
        tokens += len(generate(model, p, max_tokens, stop_ids=(eos,)))
    wall = time.perf_counter() - start - sum(ttfts)  # the first-token runs above are extra work, not counted
    return {"requests": len(prompts), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1)}


def start_server(ckpt: Path, options: list[str], tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """`astrai serve` on a free port: (process, base url, served model id)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp / f"server-{port}.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--model", str(ckpt), "--port",
                                   str(port), *options], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(THREADS)},
                                  stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            return server, url, httpx.get(f"{url}/v1/models", timeout=1).json()["data"][0]["id"]
        except httpx.TransportError:
            if server.poll() is not None:
                raise SystemExit(f"astrai serve exited:\n{(tmp / f'server-{port}.log').read_text()}")
            time.sleep(0.2)
    server.kill()
    raise SystemExit("astrai serve did not start in 2 minutes")


def peer(venv: Path, ckpt: Path, tokenizer, levels: list[int], args, tmp: Path) -> dict:
    """The same model exported with `astrai export-hf`, served by `transformers serve --continuous-batching` from
    `venv` (a separate venv with transformers[serving]), measured like astrai serve over the same prompts. Its
    /v1/completions takes text only, so each prompt is sent as its decoded text."""
    if not (venv / "bin" / "transformers").exists():
        return {"error": f"{venv}/bin/transformers not found: make that venv with transformers[serving]"}
    hf = tmp / "hf-export"
    subprocess.run([sys.executable, "-m", "flows.cli", "export-hf", str(ckpt), str(hf)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp / "peer.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([str(venv / "bin" / "transformers"), "serve", str(hf), "--continuous-batching",
                                   "--host", "127.0.0.1", "--port", str(port)], cwd=tmp, stdout=log,
                                  stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(THREADS),
                                       "PYTHONPATH": ""})
    try:
        for _ in range(600):
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except (httpx.TransportError, httpx.HTTPStatusError):
                if server.poll() is not None:
                    return {"error": f"transformers serve exited {server.returncode}: "
                                     f"{log_path.read_text()[-2000:]}"}
                time.sleep(0.2)
        else:
            return {"error": "transformers serve did not start in 2 minutes"}
        warm = [tokenizer.decode(p) for p in prompts_for(tokenizer, 2, 8, 16, seed=99)]
        asyncio.run(load_level(url, str(hf), warm, 2, 4, kv_metrics=False))
        rows = []
        for i, c in enumerate(levels):
            n = args.requests or (max(4, c) if args.quick else max(8, 2 * c))
            texts = [tokenizer.decode(p) for p in prompts_for(tokenizer, n, args.min_prompt, args.max_prompt, seed=i)]
            row = repeated_level(url, str(hf), texts, c, args.max_tokens, args.repeats, kv_metrics=False)
            del row["kv_blocks_used_peak"]
            rows.append(row)
            print("peer", json.dumps(row), flush=True)
        return {"server": "transformers serve --continuous-batching", "levels": rows}
    except Exception as e:  # noqa: BLE001 - the peer is a comparison: report why it failed, keep our numbers
        return {"error": f"{type(e).__name__}: {e}; log: {log_path.read_text()[-2000:]}"}
    finally:
        stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


def shared_prefix(ckpt: Path, tokenizer, context: int, tmp: Path, repeats: int, requests: int = 16,
                  concurrency: int = 4) -> dict:
    """Time to first token when every prompt starts with the same half-context prefix (a long shared system
    prompt), with the prefix cache and without (--no-prefix-cache): a fresh server each."""
    header = prompts_for(tokenizer, 1, context // 2, context // 2, seed=1000)[0]
    prompts = [header + tail for tail in prompts_for(tokenizer, requests, 8, 24, seed=1001)]
    out = {"prefix_tokens": len(header), "requests": requests, "concurrency": concurrency, "max_tokens": 8}
    for name, options in (("prefix_cache", []), ("no_prefix_cache", ["--no-prefix-cache"])):
        server, url, model_id = start_server(ckpt, options, tmp)
        try:
            asyncio.run(load_level(url, model_id, prompts_for(tokenizer, 2, 8, 16, seed=99), 2, 4))  # warm-up
            row = repeated_level(url, model_id, prompts, concurrency, 8, repeats)
            m = metrics(url)
            out[name] = {k: row[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")}
            out[name]["prefix_cache_hit_rate"] = round(m["astrai_prefix_cache_hits_total"]
                                                       / max(1, m["astrai_prefix_cache_queries_total"]), 3)
            print(name, json.dumps(out[name]), flush=True)
        finally:
            stop_server(server)
    out["ttft_p50_ratio_without_over_with"] = round(out["no_prefix_cache"]["ttft_p50_ms"]
                                                    / out["prefix_cache"]["ttft_p50_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: random weights at the demo shape)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1, 4, 16 and fewer requests")
    ap.add_argument("--levels", type=int, nargs="*", help="concurrency levels (default 1 4 16 64)")
    ap.add_argument("--requests", type=int, help="requests per level (default: max(8, 2 x concurrency); quick: "
                                                 "max(4, concurrency))")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level; the median is reported")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=160)
    ap.add_argument("--serve-args", default="", help="extra `astrai serve` options, e.g. '--no-prefix-cache'")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the server and the naive loop (1: "
                    "on a shared, loaded machine two threads that wait on each other run up to 10x slower)")
    ap.add_argument("--no-prefix-scenario", action="store_true", help="skip the shared-prefix TTFT comparison")
    ap.add_argument("--peer-venv", type=Path, help="a venv with transformers[serving]: also measure `transformers "
                    "serve --continuous-batching` on the same model (exported with astrai export-hf)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "serving_report.json")
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    torch.set_num_threads(args.threads)
    levels = args.levels or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
    report = {"machine": machine(), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                                if k != "out"}}

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.model) if args.model else demo_shape_checkpoint(Path(tmp))
        model, tokenizer, cfg = load_model(ckpt)
        report["model"] = {"checkpoint": str(args.model or "random weights, demo shape"), **cfg.model_dump(
            include={"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"}),
            "parameters": sum(p.numel() for p in model.parameters())}
        server, url, model_id = start_server(ckpt, ["--max-batch-size", str(max(levels)), *args.serve_args.split()],
                                             Path(tmp))
        try:
            m = metrics(url)
            report["kv_pool"] = {"blocks": int(m["astrai_kv_blocks_total"]),
                                 "mib": round(m["astrai_kv_cache_bytes"] / 2**20, 1)}
            bytes_per_block = m["astrai_kv_cache_bytes"] / m["astrai_kv_blocks_total"]
            asyncio.run(load_level(url, model_id, prompts_for(tokenizer, 2, 8, 16, seed=99), 2, 4))  # warm-up
            report["served"] = []
            for i, c in enumerate(levels):
                n = args.requests or (max(4, c) if args.quick else max(8, 2 * c))
                prompts = prompts_for(tokenizer, n, args.min_prompt, args.max_prompt, seed=i)
                row = repeated_level(url, model_id, prompts, c, args.max_tokens, args.repeats)
                row["kv_mib_used_peak"] = round(row["kv_blocks_used_peak"] * bytes_per_block / 2**20, 2)
                report["served"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop_server(server)
        if args.peer_venv:
            report["peer"] = peer(args.peer_venv, ckpt, tokenizer, levels, args, Path(tmp))
        if not args.no_prefix_scenario:
            report["shared_prefix"] = shared_prefix(ckpt, tokenizer, cfg.max_seq_len, Path(tmp), args.repeats)
        n = args.requests or (4 if args.quick else 8)
        naive_prompts = prompts_for(tokenizer, n, args.min_prompt, args.max_prompt, seed=0)
        report["naive"] = median_run([naive(model, naive_prompts, args.max_tokens, special_id(tokenizer, "eos"))
                                      for _ in range(args.repeats)])
        print("naive", json.dumps(report["naive"]), flush=True)
    base = report["naive"]["output_tokens_per_s"]
    report["speedup_over_naive"] = {str(r["concurrency"]): round(r["output_tokens_per_s"] / base, 2)
                                    for r in report["served"]}
    if "levels" in report.get("peer", {}):
        report["speedup_over_peer"] = {str(a["concurrency"]): round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 2)
                                       for a, b in zip(report["served"], report["peer"]["levels"])}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
