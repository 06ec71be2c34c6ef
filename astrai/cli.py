"""The `astrai` command line. Run `astrai --help`, or `astrai COMMAND --help`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from astrai import env

env.apply()  # before Prefect, MLflow or DVC is imported

from astrai_core.errors import AstraiError  # noqa: E402

app = typer.Typer(help="AstrAI pipeline: corpus -> tokenizer -> HDF5 -> torchrun pretraining -> SFT -> DPO -> GRPO -> "
                       "evaluation -> MLflow registry.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _fail(msg: str) -> None:
    typer.echo(f"astrai: error: {msg}", err=True)
    raise typer.Exit(2)


def _parse_override(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        _fail(f"--set {item!r}: expected KEY=VALUE, e.g. pretrain.max_steps=50")
    key, value = item.split("=", 1)
    return key.strip(), yaml.safe_load(value)


@app.command()
def pipeline(
    params: Path = typer.Option(Path("params.yaml"), help="Params file for this run (params.yaml itself is left as it is)."),
    set_: list[str] = typer.Option([], "--set", help="Override a param for this run: KEY=VALUE with a dotted key. Repeatable."),
    profile: Optional[str] = typer.Option(None, help="profiles/NAME.yaml merged over the params for this run "
                                          "(quick: the whole chain in about a minute); --set wins over it."),
) -> None:
    """Run the whole pipeline as a Prefect flow in this process (a temporary Prefect server starts when
    PREFECT_API_URL is unset), then print where the results are."""
    from tasks.params import params_of_run, restore_user_params

    overrides = dict(_parse_override(s) for s in set_)
    try:
        if note := restore_user_params(Path()):  # a killed run's params.yaml is not the user's: theirs back first
            typer.echo(f"{note} (left by an interrupted run)")
        resolved = params_of_run(Path(), str(params), overrides, profile)  # a bad key stops here, before Prefect
        from flows.pipeline import pipeline as flow

        result = flow(params_path=str(params), overrides=overrides or None, profile=profile, resolved=resolved)
    except AstraiError as e:
        _fail(str(e))
    _print_summary(result)


def _print_summary(result: dict) -> None:
    reg, m = result["registration"], result["metrics"]
    print("\n=== AstrAI pipeline finished ===")
    print(f"stages:           {', '.join(f'{k}={v}' for k, v in result['stages'].items())}")
    print(f"MLflow store:     {result['mlflow_tracking_uri']}  (experiment '{result['mlflow_experiment']}')")
    if result.get("up_to_date"):
        print("nothing ran:      every stage is up to date (dvc status); below: the results of the run that made them")
    else:
        print(f"MLflow run:       {result['mlflow_parent_run_id']}  (open: make mlflow-ui)")
    print(f"registered model: {reg['model_uri'] or 'none'}  aliases: {', '.join(reg['aliases']) or 'none'}")
    print(f"registered stage: {reg['stage']} (the chain's best on {reg['metric']}: register.metric)")
    print(f"decision:         {reg['decision']}")
    print(f"test bits/char:   {m['test_bits_per_char']:.4f}  (unigram baseline {m['unigram_bits_per_char']:.4f})")
    print(f"test loss / ppl:  {m['test_loss']:.4f} / {m['test_perplexity']:.2f}  (final model: {m['final_model']})")
    print(f"samples:          {result['samples']}")
    print(f"plots:            {Path(result['samples']).with_name('chain.png')}, "
          f"{Path(result['samples']).with_name('curves.png')}")
    evaluation = Path(result["samples"]).with_name("evaluation.md")
    if evaluation.is_file():
        print(evaluation.read_text())
    samples = Path(result["samples"]).read_text()
    if len(samples) > 1500:  # cut at a line end, and say where the rest is
        samples = samples[: samples.rfind("\n", 0, 1500) + 1] + f"... (all samples: {result['samples']})"
    print(samples)


@app.command()
def stage(name: str = typer.Argument(..., help="corpus | tokenizer | pack | pretrain | chat_data | sft | dpo_reference | "
                                                "dpo | grpo | evaluate | register"),
          params: Path = typer.Option(Path("params.yaml"), help="Params file.")) -> None:
    """Run one stage in the current directory (this is what dvc.yaml calls)."""
    from tasks.params import load_params
    from tasks.stages import STAGES, run_stage

    if name not in STAGES:
        _fail(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    try:
        run_stage(name, load_params(params))
    except AstraiError as e:
        _fail(str(e))


@app.command()
def train(config: Path = typer.Option(..., help="TrainConfig JSON or YAML (see astrai_core/config.py)."),
          nproc: str = typer.Option("auto", help="Processes per node for torchrun (auto: every GPU, else every CPU core).")) -> None:
    """Run the training core on its own under torchrun (no Prefect, DVC or MLflow run needed)."""
    from pydantic import ValidationError

    from astrai_core.config import TrainConfig
    from astrai_core.distributed import launch, resolve_nproc
    from tasks.params import load_raw, validation_message

    try:
        cfg = TrainConfig.model_validate(load_raw(config))
        launch(cfg, resolve_nproc(int(nproc) if nproc != "auto" else "auto", cfg.device))
    except ValidationError as e:
        _fail(f"{config}: {validation_message(e)}")
    except AstraiError as e:
        _fail(str(e))


@app.command()
def generate(model: str = typer.Option(..., help="A checkpoint directory or an MLflow URI like models:/astrai@champion."),
             prompt: str = typer.Option(..., help="Text to continue."),
             max_new_tokens: int = typer.Option(100, help="Tokens to generate."),
             temperature: float = typer.Option(0.0, help="0 = greedy."),
             top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = all)."),
             top_p: float = typer.Option(1.0, help="Sample from the smallest set of tokens with this much probability."),
             chat: bool = typer.Option(False, "--chat", help="PROMPT is a user message: reply in the chat format "
                                       "(the template stored with the checkpoint's tokenizer), as SFT trained."),
             seed: int = typer.Option(0, help="Sampling seed.")) -> None:
    """Generate a continuation of PROMPT (or, with --chat, a reply to it) with a checkpoint or a registered model."""
    for bad, msg in ((not prompt, "--prompt: empty; give some text to continue"),
                     (max_new_tokens < 1, f"--max-new-tokens {max_new_tokens}: must be at least 1"),
                     (temperature < 0, f"--temperature {temperature}: must be >= 0 (0 = greedy)"),
                     (top_k < 0, f"--top-k {top_k}: must be >= 0 (0 = all tokens)"),
                     (not 0 < top_p <= 1, f"--top-p {top_p}: must be in (0, 1]")):
        if bad:
            _fail(msg)
    if chat:
        import torch

        from astrai_core.chat import load_chat
        from astrai_core.checkpoint import load_model
        from astrai_core.generate import generate

        if model.startswith(("models:/", "runs:/")):
            _fail("--chat needs a checkpoint directory (e.g. data/grpo); for a registered model download it first")
        try:
            m, _, _ = load_model(model)
            fmt = load_chat(Path(model) / "tokenizer.json")
            ids = fmt.encode_prompt([{"role": "user", "content": prompt}])
        except AstraiError as e:
            _fail(str(e))
        out = generate(m, ids, max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p,
                       stop_ids=fmt.stop_ids, generator=torch.Generator().manual_seed(seed))
        print(fmt.decode_reply(out))
        return
    if model.startswith(("models:/", "runs:/")):
        import mlflow
        from mlflow.exceptions import MlflowException

        _use_tracking_store()
        try:
            pyfunc = mlflow.pyfunc.load_model(model)
        except MlflowException as e:  # no such model, version or alias
            _fail(f"{model}: {str(e).splitlines()[0]}")
        text = pyfunc.predict([prompt], params={"max_new_tokens": max_new_tokens, "temperature": temperature,
                                                "top_k": top_k, "seed": seed})[0]
    else:
        import torch

        from astrai_core.checkpoint import load_model
        from astrai_core.generate import generate_text

        try:
            m, tok, _ = load_model(model)
        except AstraiError as e:
            _fail(str(e))
        text = generate_text(m, tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k or None, top_p=top_p, generator=torch.Generator().manual_seed(seed))
    print(prompt + text)


def _use_tracking_store() -> None:
    """Point MLflow at the store the pipeline uses: MLFLOW_TRACKING_URI, else params.yaml's tracking.uri, else
    mlflow/ in the current directory."""
    import mlflow

    from tasks.params import Params, load_params
    from tasks.tracking import tracking_uri

    params = load_params("params.yaml") if Path("params.yaml").is_file() else Params()
    mlflow.set_tracking_uri(tracking_uri(params, Path.cwd()))


def _download_registered(uri: str, dst: Path) -> tuple[Path, str, list[str]]:
    """The checkpoint directory of registered model `uri` (models:/NAME@ALIAS or models:/NAME/VERSION), downloaded
    under dst, the served model id NAME/VERSION, and the ids it is also served as: NAME, and NAME@ALIAS."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per file in the server's log
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    ref = uri.removeprefix("models:/")
    name, sep, which = ref.partition("@") if "@" in ref else ref.rpartition("/")
    if not (name and sep and which):
        _fail(f"{uri}: expected models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint directory")
    _use_tracking_store()
    client = mlflow.MlflowClient()
    try:
        mv = client.get_model_version_by_alias(name, which) if sep == "@" else client.get_model_version(name, which)
        local = mlflow.artifacts.download_artifacts(f"models:/{name}/{mv.version}", dst_path=str(dst))
    except MlflowException as e:
        _fail(f"{uri}: {str(e.message).splitlines()[0]} (store: {mlflow.get_tracking_uri()})")
    # The register stage logs the checkpoint directory as the pyfunc artifact "checkpoint"; MLmodel says where.
    artifacts = Model.load(local).flavors.get("python_function", {}).get("artifacts", {})
    if "checkpoint" not in artifacts:
        _fail(f"{uri}: the model version has no checkpoint artifact (not registered by `astrai stage register`?)")
    return Path(local) / artifacts["checkpoint"]["path"], f"{name}/{mv.version}", [name] + ([ref] if sep == "@" else [])


@app.command()
def serve(model: str = typer.Option("models:/astrai@champion", help="models:/NAME@ALIAS, models:/NAME/VERSION "
                                    "(from the pipeline's MLflow store) or a checkpoint directory."),
          host: str = typer.Option("127.0.0.1", help="Address to bind (a non-loopback one needs --api-key or --insecure)."),
          port: int = typer.Option(8000, help="TCP port."),
          api_key: Optional[str] = typer.Option(None, envvar="ASTRAI_API_KEY", show_envvar=True,
                                                help="Clients must send it ('Authorization: Bearer KEY' or 'x-api-key: KEY')."),
          insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without an API key."),
          kv_blocks: Optional[int] = typer.Option(None, help="KV cache blocks in the pool (default: from --kv-memory-mb)."),
          kv_memory_mb: Optional[float] = typer.Option(None, help="KV cache size in MiB when --kv-blocks is not given."),
          block_size: Optional[int] = typer.Option(None, help="Tokens per KV block."),
          max_batch_size: Optional[int] = typer.Option(None, help="Requests decoded together at most."),
          max_waiting: Optional[int] = typer.Option(None, help="Requests queued at most; more are refused with 503."),
          no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Do not share KV blocks of equal "
                                               "prompt prefixes between requests."),
          batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Bit-identical results whatever "
                                               "shares a request's batch (greedy output equals generate() alone "
                                               "even at near-ties); slower."),
          device: str = typer.Option("auto", help="auto (cuda when present, else cpu), cpu or cuda."),
          threads: str = typer.Option("auto", help="torch intra-op threads: auto = the cores this process may use "
                                      "minus one, kept for the HTTP event loop (at least 1; OMP_NUM_THREADS wins "
                                      "when set), or a number."),
          engine_process: bool = typer.Option(True, "--engine-process/--engine-thread", help="Run the engine in a "
                                              "process of its own (default: the HTTP event loop and the engine then "
                                              "do not share one GIL) or in a thread of the server's process.")) -> None:
    """Serve a model over HTTP with OpenAI- and Anthropic-compatible routes (/v1/chat/completions,
    /v1/completions, /v1/messages, /v1/models), /health, /metrics and a chat page at /, on the continuous-batching
    engine. Engine options left out take the engine's defaults (astrai_core/engine/engine.py EngineConfig); the
    start-up line says what they came to."""
    import ipaddress
    import tempfile

    import torch
    import uvicorn

    from astrai_core.chat import load_chat
    from astrai_core.checkpoint import load_model
    from astrai_core.engine import Engine, EngineConfig, EngineProcess
    from serving.app import create_app

    api_key = api_key or None  # an empty ASTRAI_API_KEY means no key
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not (loopback or api_key or insecure):
        _fail(f"--host {host} is reachable from other machines: set --api-key (or ASTRAI_API_KEY), or pass --insecure "
              "to serve without a key")
    _check_port_free(host, port)  # before the model loads: uvicorn would say it in lines of its own, exit 3
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        _fail(f"--device {device}: expected auto, cpu or cuda (and cuda needs a GPU build of torch and a GPU)")
    n_threads, why = _serve_threads(threads)
    options = {"kv_blocks": kv_blocks, "kv_memory_mb": kv_memory_mb, "block_size": block_size,
               "max_batch_size": max_batch_size, "max_waiting": max_waiting}
    with tempfile.TemporaryDirectory(prefix="astrai-serve-") as tmp:  # a registry download, gone once loaded
        aliases: list[str] = []
        if model.startswith("models:/"):
            checkpoint, model_id, aliases = _download_registered(model, Path(tmp))
        elif Path(model).is_dir():
            checkpoint, model_id = Path(model), Path(model).resolve().name
        else:
            _fail(f"{model}: no such checkpoint directory (or give models:/NAME@ALIAS or models:/NAME/VERSION)")
        try:
            chat = load_chat(checkpoint / "tokenizer.json")
            config = EngineConfig(**{k: v for k, v in options.items() if v is not None},
                                  prefix_cache=not no_prefix_cache, batch_invariant=batch_invariant)
            if engine_process:
                engine = EngineProcess(checkpoint, config, device=device, threads=n_threads)
            else:
                torch.set_num_threads(n_threads)
                engine = Engine(load_model(checkpoint, device=device)[0], config)
        except (AstraiError, ValueError) as e:
            _fail(str(e))
    application = create_app(engine, chat, model_id, api_key=api_key, aliases=aliases)
    c = engine.config
    typer.echo(f"astrai: serving {', '.join([model_id, *aliases])} on http://{host}:{port}/v1 ({device}, {n_threads} torch thread(s): "
               f"{why}; engine {'process' if engine_process else 'thread'}; batch cap {c.max_batch_size}, {engine.stats()['kv_blocks_total']} KV blocks of "
               f"{c.block_size} tokens, queue {c.max_waiting})", err=True)
    engine.start()
    try:
        uvicorn.run(application, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.stop()


def _check_port_free(host: str, port: int) -> None:
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
            s.bind((host, port))
    except OSError as e:
        _fail(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server using it?")


def _serve_threads(choice: str) -> tuple[int, str]:
    """(torch threads, why). On 2 cores torch's default of 2 threads spin-waits on the core the event loop needs:
    measured at 2 concurrent streams, 530 tokens/s with 2 threads against 1,511 with 1 (docs/design.md)."""
    if choice != "auto":
        if not choice.isdigit() or int(choice) < 1:
            _fail(f"--threads {choice}: expected auto or a number >= 1")
        return int(choice), "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1), f"{cores} core(s), one left for the event loop"


@app.command("export-hf")
def export_hf(checkpoint: Path = typer.Argument(..., help="An astrai checkpoint directory (e.g. data/pretrain)."),
              out: Path = typer.Argument(..., help="Directory to write (replaced if it exists).")) -> None:
    """Write CHECKPOINT as a Hugging Face model directory OUT (config.json, model.safetensors, tokenizer files,
    generation_config.json) that transformers' AutoModelForCausalLM / AutoTokenizer load. Options with no
    matching transformers architecture are refused."""
    from astrai_core.hf import export_hf as export

    try:
        path = export(checkpoint, out)
    except AstraiError as e:
        _fail(str(e))
    print(f"wrote {path} ({json.loads((path / 'config.json').read_text())['architectures'][0]})")


@app.command("export-gguf")
def export_gguf(model: str = typer.Argument(..., help="An astrai checkpoint directory (e.g. data/pretrain), or "
                                            "models:/NAME@ALIAS or models:/NAME/VERSION from the pipeline's MLflow store."),
                out: Path = typer.Argument(..., help="GGUF file to write (replaced if it exists)."),
                type_: str = typer.Option("f32", "--type", help="f32 (the checkpoint's numbers) or q8_0 (8-bit "
                                          "blocks, about a quarter of the size).")) -> None:
    """Write MODEL as one GGUF file OUT that llama.cpp runs (llama-cli, llama-server, ...): weights, the tokenizer
    (with astrai's special tokens as control tokens) and the chat template. Options that llama.cpp's llama and
    arcee architectures do not compute are refused."""
    import tempfile

    from astrai_core.gguf_export import TYPES, export_gguf as export

    if type_ not in TYPES:
        _fail(f"--type {type_}: expected one of {', '.join(TYPES)}")
    with tempfile.TemporaryDirectory(prefix="astrai-gguf-") as tmp:  # a registry download, gone once written
        checkpoint = _download_registered(model, Path(tmp))[0] if model.startswith("models:/") else Path(model)
        try:
            path = export(checkpoint, out, type_)
        except AstraiError as e:
            _fail(str(e))
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {type_})")


@app.command("import-hf")
def import_hf(hf_dir: Path = typer.Argument(..., help="A Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, ...)."),
              out: Path = typer.Argument(..., help="Checkpoint directory to write (replaced if it exists).")) -> None:
    """Convert the Hugging Face model in HF_DIR into an astrai checkpoint directory OUT, a starting point for
    any stage (safetensors weights and tokenizer.json needed; nothing is downloaded). astrai's special tokens
    that the tokenizer lacks are added (summary.json in OUT records them), growing vocab_size if needed."""
    from astrai_core.hf import import_hf as import_

    try:
        path = import_(hf_dir, out)
    except AstraiError as e:
        _fail(str(e))
    report = json.loads((path / "summary.json").read_text())  # what import added to the HF tokenizer and model
    added, reused = (", ".join(f"{name}={i}" for name, i in sorted(report[key].items(), key=lambda kv: kv[1])) or "none"
                     for key in ("special_tokens_added", "special_tokens_reused"))
    vocab = report["vocab_size"]
    print(f"wrote {path}\nspecial tokens added: {added}; reused: {reused}\nvocab_size {vocab['hf']} -> "
          f"{vocab['astrai']} (rows of added tokens: the mean of the known vocabulary's rows)")


def main() -> None:
    # A stage's progress lines (and a Slurm job's, which it relays) reach a pipe, a tee or a log as they happen,
    # not in 8 KiB blocks: Ctrl-C and the eta then refer to what the reader has seen.
    sys.stdout.reconfigure(line_buffering=True)
    try:
        app()
    except AstraiError as e:
        typer.echo(f"astrai: error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
