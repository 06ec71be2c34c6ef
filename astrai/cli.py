"""The `astrai` command line. Run `astrai --help`, or `astrai COMMAND --help`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from astrai_core.runtime import env

env.apply()  # before Prefect, MLflow or DVC is imported

from tasks.registry.models import REFERENCE_HELP  # noqa: E402

DTYPE_HELP = ("The weights' dtype: auto (bf16 where the device computes bf16 natively and the model is big enough for "
              "it to pay, as measured in astrai_core/runtime/device.py; else fp32), fp32 or bf16.")
from astrai_core.runtime.errors import AstraiError, Interrupted  # noqa: E402
from tasks.run.log import command_log, crash_line, log_file, shown  # noqa: E402
try:
    from tasks.run.table import STAGES  # noqa: E402
except AstraiError as e:  # an edit left the stage table without a stage the others read: every command says so
    print(f"astrai: error: {e}", file=sys.stderr)
    sys.exit(2)

app = typer.Typer(help="AstrAI pipeline: corpus -> tokenizer -> HDF5 -> torchrun pretraining -> SFT -> DPO -> GRPO -> "
                       "evaluation -> MLflow registry.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _fail(msg: str) -> None:
    typer.echo(f"astrai: error: {msg}", err=True)
    raise typer.Exit(2)


def _with_log(msg: str, log: Path | None) -> str:
    """A stage's or a training run's error line, naming the log that holds all it printed (tasks/run/log.py)."""
    return f"{msg} (full log: {shown(log)})" if log else msg


def _parse_override(item: str) -> tuple[str, object]:
    import yaml

    if "=" not in item:
        _fail(f"--set {item!r}: expected KEY=VALUE, e.g. pretrain.max_steps=50")
    key, value = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as e:  # e.g. an unclosed [ or {: quote a string that starts with one
        _fail(f"--set {item!r}: the value is not valid YAML ({getattr(e, 'problem', None) or type(e).__name__})")


@app.command()
def pipeline(
    params: Path = typer.Option(Path("params.yaml"), help="Params file for this run (params.yaml itself is left as it is)."),
    set_: list[str] = typer.Option([], "--set", help="Override a param for this run: KEY=VALUE with a dotted key. Repeatable."),
    profile: Optional[str] = typer.Option(None, help="profiles/NAME.yaml merged over the params for this run "
                                          "(quick: the whole chain in about 2 minutes); --set wins over it."),
) -> None:
    """Run the whole pipeline as a Prefect flow in this process (a temporary Prefect server starts when
    PREFECT_API_URL is unset), then print where the results are."""
    from tasks.run.checks import check_cluster
    from tasks.run.lock import checkout_lock
    from tasks.run.params import params_of_run, restore_user_params

    overrides = dict(_parse_override(s) for s in set_)
    try:
        # One run per checkout, taken before params.yaml is touched: a second run stops here naming the first.
        with checkout_lock(Path(), log=_note, dvc_free=True):
            if note := restore_user_params(Path()):  # a killed run's params.yaml is not the user's: theirs back first
                typer.echo(f"{note} (left by an interrupted run)")
            resolved = params_of_run(Path(), str(params), overrides, profile)  # a bad key stops here, before Prefect
            check_cluster(resolved.params, Path.cwd(), str(params))  # and what launcher slurm needs of this machine
            server = contextlib.nullcontext()
            if not os.environ.get("PREFECT_API_URL"):
                if why := prefect_home_problem():
                    _fail(why)
                from astrai.services import temporary_prefect_server

                server = temporary_prefect_server(prefect_home())
            with server:
                from flows.pipeline import pipeline as flow

                result = flow(params_path=str(params), overrides=overrides or None, profile=profile, resolved=resolved)
    except AstraiError as e:
        _fail(str(e))
    except typer.Exit:
        raise
    except Exception as e:  # noqa: BLE001 - a Prefect server that stopped answering, else a bug (main's crash line)
        if not (outage := prefect_outage(e)):
            raise
        _fail(outage)
    _print_summary(result)


def prefect_outage(e: Exception) -> str | None:
    """The one line for a Prefect server that does not answer or fails its requests (its database went down under
    a run: PrefectHTTPStatusError; unreachable: "Failed to reach API"), or None for any other exception."""
    import httpx

    prefect_errors = sys.modules.get("prefect.exceptions")  # loaded once the flow ran (an import here prints warnings)
    http_status = (prefect_errors.PrefectHTTPStatusError,) if prefect_errors else ()
    if not (isinstance(e, (*http_status, httpx.HTTPError))
            or (isinstance(e, RuntimeError) and str(e).startswith("Failed to reach API"))):
        return None
    url = os.environ.get("PREFECT_API_URL", "the temporary one")
    return (f"the Prefect server ({url}) did not answer ({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})"
            "; once it answers again, run the pipeline again (finished stages are not repeated)")


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser().absolute()


def prefect_home_problem() -> str | None:
    """Why a temporary Prefect server could not keep its database in PREFECT_HOME (default ~/.prefect), or None.
    Checked just before `astrai pipeline` starts one, by making PREFECT_HOME (as Prefect would a moment later) and a
    file in it: otherwise the run waits out the start-up timeout and ends on Prefect's "Timed out while attempting to
    connect", which does not say where. (Permission bits alone do not tell: root may write anywhere but /proc.)"""
    home = prefect_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=home).close()
    except OSError as e:
        return (f"PREFECT_HOME={home}: the temporary Prefect server cannot keep its database there "
                f"({e.strerror or e}); set PREFECT_HOME to a writable directory, or PREFECT_API_URL to a Prefect server")
    return None


def _note(msg: str) -> None:
    typer.echo(f"astrai: {msg}", err=True)


def _print_summary(result: dict) -> None:
    reg, m = result["registration"], result["metrics"]
    print("\n=== AstrAI pipeline finished ===")
    print(f"stages:           {', '.join(f'{k}={v}' for k, v in result['stages'].items())}")
    print(f"MLflow store:     {result['mlflow_tracking_uri']}  (experiment '{result['mlflow_experiment']}')")
    if result.get("up_to_date"):
        print("nothing ran:      every stage is up to date (dvc status); below: the results of the run that made them")
    else:
        print(f"MLflow run:       {result['mlflow_parent_run_id']}")
    served = result["mlflow_tracking_uri"].startswith(("http://", "https://"))  # else a local store: its UI is make's
    print(f"MLflow UI:        {result['mlflow_ui']}" + ("" if served else "  (after: make mlflow-ui)"))
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
def stage(name: str = typer.Argument(..., help=" | ".join(s.name for s in STAGES) + " (tasks/run/table.py)"),
          params: Path = typer.Option(Path("params.yaml"), help="Params file.")) -> None:
    """Run one stage in the current directory (this is what dvc.yaml calls)."""
    from tasks.run.lock import checkout_lock
    from tasks.run.params import load_params
    from tasks.stages.runner import RUNNERS, run_stage

    if name not in RUNNERS:
        _fail(f"unknown stage {name!r}; stages: {', '.join(RUNNERS)}")
    try:
        loaded = load_params(params)
    except AstraiError as e:
        _fail(str(e))
    from mlflow.exceptions import MlflowException

    with command_log(Path(), f"stage-{name}") as log:
        try:
            with checkout_lock(Path(), log=_note):  # the pipeline's own stages pass: they carry its token
                run_stage(name, loaded)
        except AstraiError as e:
            _fail(_with_log(str(e), log))
        except MlflowException as e:
            if not (outage := tracking_outage(e)):
                raise
            _fail(_with_log(f"stage {name}: {outage}", log))


def tracking_outage(e: Exception) -> str | None:
    """The one line for an MLflow tracking server that stopped answering (MLflow's client gave up after its retries:
    "API request to URL failed with exception ..."), or None for any other MLflow error."""
    import mlflow

    message = str(getattr(e, "message", e)).strip()
    if not message.startswith("API request to "):
        return None
    return (f"the MLflow tracking server at {mlflow.get_tracking_uri()} did not answer ({message.splitlines()[0][:200]}"
            "); once it answers again, run the stage again")


@app.command()
def train(config: Path = typer.Option(..., help="TrainConfig JSON or YAML (see astrai_core/training/config.py)."),
          nproc: str = typer.Option("auto", help="Processes per node for torchrun (auto: every GPU, else every CPU core).")) -> None:
    """Run the training core on its own under torchrun (no Prefect, DVC or MLflow run needed)."""
    if nproc != "auto" and not (nproc.isdigit() and int(nproc) >= 1):
        _fail(f"--nproc {nproc}: expected auto or a number of processes >= 1")
    from pydantic import ValidationError

    from astrai_core.training.config import TrainConfig
    from astrai_core.training.distributed import launch, resolve_nproc
    from astrai_core.training.train import check_train_inputs
    from tasks.run.params import load_raw, validation_message

    try:
        cfg = TrainConfig.model_validate(load_raw(config))
    except ValidationError as e:
        _fail(f"{config}: {validation_message(e)}")
    except AstraiError as e:
        _fail(str(e))
    with command_log(Path(), "train") as log:
        try:
            check_train_inputs(cfg)
            launch(cfg, resolve_nproc(int(nproc) if nproc != "auto" else "auto", cfg.device))
        except AstraiError as e:
            _fail(_with_log(str(e), log))


@app.command()
def generate(model: str = typer.Option(..., help=f"The model: {REFERENCE_HELP}."),
             prompt: str = typer.Option(..., help="Text to continue."),
             max_new_tokens: int = typer.Option(100, help="Tokens to generate."),
             temperature: float = typer.Option(0.0, help="0 = greedy."),
             top_k: int = typer.Option(0, help="Sample from the k most likely tokens (0 = all)."),
             top_p: float = typer.Option(1.0, help="Sample from the smallest set of tokens with this much probability."),
             chat: bool = typer.Option(False, "--chat", help="PROMPT is a user message: reply in the chat format "
                                       "(the template stored with the checkpoint's tokenizer), as SFT trained."),
             seed: int = typer.Option(0, help="Sampling seed."),
             device: str = typer.Option("auto", help="auto (cuda when present, else cpu), cpu or cuda."),
             dtype: str = typer.Option("auto", help=DTYPE_HELP)) -> None:
    """Generate a continuation of PROMPT (or, with --chat, a reply to it) with a checkpoint or a registered model."""
    for bad, msg in ((not prompt, "--prompt: empty; give some text to continue"),
                     (max_new_tokens < 1, f"--max-new-tokens {max_new_tokens}: must be at least 1"),
                     (not temperature >= 0 or math.isinf(temperature),  # nan compares false
                      f"--temperature {temperature}: must be a finite number >= 0 (0 = greedy)"),
                     (top_k < 0, f"--top-k {top_k}: must be >= 0 (0 = all tokens)"),
                     (not 0 < top_p <= 1, f"--top-p {top_p}: must be in (0, 1]")):
        if bad:
            _fail(msg)
    import tempfile

    import torch

    from tasks.registry.models import resolve_model
    from astrai_core.checkpoint.model_dir import inference_dtype_of, load_model
    from astrai_core.inference.generate import generate, generate_text
    from astrai_core.runtime.device import check_dtype_choice, resolve_device
    from astrai_core.tokenizer.chat import load_chat

    with tempfile.TemporaryDirectory(prefix="astrai-generate-") as tmp:  # a registry download, gone once loaded
        try:
            check_dtype_choice(dtype)
            where = resolve_device(device)
            checkpoint = resolve_model(model, Path(tmp)).checkpoint
            m, tok, _ = load_model(checkpoint, device=where, dtype=inference_dtype_of(checkpoint, dtype, where)[0])
            fmt = load_chat(checkpoint / "tokenizer.json") if chat else None
        except (AstraiError, ValueError) as e:
            _fail(str(e))
    sampling = dict(temperature=temperature, top_k=top_k or None, top_p=top_p,
                    generator=torch.Generator(where).manual_seed(seed))
    if fmt is not None:
        try:
            ids = fmt.encode_prompt([{"role": "user", "content": prompt}])
        except AstraiError as e:
            _fail(str(e))
        print(fmt.decode_reply(generate(m, ids, max_new_tokens, stop_ids=fmt.stop_ids, **sampling)))
        return
    print(prompt + generate_text(m, tok, prompt, max_new_tokens=max_new_tokens, **sampling))


@app.command()
def serve(model: str = typer.Option("models:/astrai@champion", help=f"The model: {REFERENCE_HELP}."),
          host: str = typer.Option("127.0.0.1", help="Address to bind (a non-loopback one needs --api-key or --insecure)."),
          port: int = typer.Option(8000, help="TCP port."),
          api_key: Optional[str] = typer.Option(None, envvar="ASTRAI_API_KEY", show_envvar=True,
                                                help="Clients must send it ('Authorization: Bearer KEY' or 'x-api-key: KEY')."),
          insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without an API key."),
          allowed_host: list[str] = typer.Option([], "--allowed-host", help="A name clients may reach the server "
                                                 "by (the Host header; repeatable), e.g. a proxy's, besides loopback "
                                                 "names and --host; requests from its web pages (Origin) are accepted "
                                                 "too. '*': any."),
          kv_blocks: Optional[int] = typer.Option(None, help="KV cache blocks in the pool (default: from --kv-memory-mb)."),
          kv_memory_mb: Optional[float] = typer.Option(None, help="KV cache size in MiB when --kv-blocks is not given "
                                                       "(default: 256, or two full contexts of the model if more)."),
          block_size: Optional[int] = typer.Option(None, help="Tokens per KV block."),
          max_batch_size: Optional[int] = typer.Option(None, help="Requests decoded together at most."),
          max_waiting: Optional[int] = typer.Option(None, help="Requests queued at most; more are refused with 503."),
          no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Do not share KV blocks of equal "
                                               "prompt prefixes between requests."),
          batch_invariant: bool = typer.Option(False, "--batch-invariant", help="Bit-identical results whatever "
                                               "shares a request's batch (greedy output equals generate() alone "
                                               "even at near-ties); slower, and fp32 weights only."),
          compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Run decode steps and prefill chunks "
                                       "as torch.compile'd graphs (default; not with --batch-invariant): about 3x "
                                       "faster per step at few streams; compiled in the background while the steps "
                                       "run eager (60-90 s cold for the demo's model on 2 cores, seconds once cached "
                                       "on disk); logits may differ from eager's in the last bits."),
          compile_first: bool = typer.Option(False, "--compile-first", help="Compile before answering the first "
                                             "request instead of in the background."),
          device: str = typer.Option("auto", help="auto (cuda when present, else cpu), cpu or cuda."),
          dtype: str = typer.Option("auto", help=DTYPE_HELP),
          pack_weights: bool = typer.Option(True, "--pack-weights/--no-pack-weights", help="bf16 projections on "
                                            "weights prepacked for oneDNN (default, where the CPU has bf16 kernels): "
                                            "the same outputs, faster; twice the projections' memory."),
          threads: str = typer.Option("auto", help="torch intra-op threads: auto = the cores this process may use, "
                                      "less one kept for the HTTP event loop with a small model (serving/launch.py "
                                      "ALL_CORES_FROM_PARAMS) or --engine-thread (at least 1; OMP_NUM_THREADS wins "
                                      "when set), or a number."),
          engine_process: bool = typer.Option(True, "--engine-process/--engine-thread", help="Run the engine in a "
                                              "process of its own (default: the HTTP event loop and the engine then "
                                              "do not share one GIL) or in a thread of the server's process."),
          alias_poll: float = typer.Option(60.0, help="With --model models:/NAME@ALIAS: look the alias up in the "
                                           "registry every this many seconds; when it points to another version than "
                                           "the one served, /health and /v1/models say so and the log gets a line "
                                           "(0: never).")) -> None:
    """Serve a model over HTTP with OpenAI- and Anthropic-compatible routes (/v1/chat/completions,
    /v1/completions, /v1/messages, /v1/models), /health, /metrics and a chat page at /, on the continuous-batching
    engine. Engine options left out take the engine's defaults (astrai_core/inference/engine/engine.py EngineConfig); the
    start-up line says what they came to. If the engine dies, the server ends its open requests and exits with
    status 1 (serving/server.py), for a supervisor to restart it."""
    if not 1 <= port <= 65535:  # before the imports: bind() would raise OverflowError
        _fail(f"--port {port}: expected a TCP port from 1 to 65535")
    if not alias_poll >= 0:
        _fail(f"--alias-poll {alias_poll:g}: expected seconds >= 0 (0: never look again)")
    import tempfile

    from tasks.registry.models import alias_version, resolve_model
    from astrai_core.checkpoint.model_dir import inference_dtype_of, read_model_config
    from astrai_core.inference.engine import EngineConfig
    from astrai_core.model.transformer import estimated_params
    from astrai_core.runtime.device import check_dtype_choice, resolve_device
    from serving.auth import check_exposure
    from serving import launch

    try:  # who must have a key (serving/auth.py), then the port: before the model loads
        api_key = check_exposure(host, api_key, insecure, allowed_host)
        launch.check_port_free(host, port)
    except ValueError as e:
        _fail(str(e))
    try:
        device = resolve_device(device).type
    except AstraiError as e:
        _fail(f"--{e}")
    try:
        check_dtype_choice(dtype)
    except ValueError as e:
        _fail(str(e))
    options = {"kv_blocks": kv_blocks, "kv_memory_mb": kv_memory_mb, "block_size": block_size,
               "max_batch_size": max_batch_size, "max_waiting": max_waiting}
    try:  # the engine's options, before the model loads (or downloads)
        config = EngineConfig(**{k: v for k, v in options.items() if v is not None},
                              prefix_cache=not no_prefix_cache, batch_invariant=batch_invariant,
                              compile=not batch_invariant if compile is None else compile,
                              compile_in_background=not compile_first, pack_weights=pack_weights)
    except ValueError as e:
        _fail(str(e))
    with tempfile.TemporaryDirectory(prefix="astrai-serve-") as tmp:  # a registry download, gone once loaded
        try:
            checkpoint, model_id, aliases = resolve_model(model, Path(tmp))
            weights, dtype_why = inference_dtype_of(checkpoint, dtype, resolve_device(device), batch_invariant)
            n_threads, why = launch.torch_threads(threads, estimated_params(read_model_config(checkpoint / "config.json")),
                                                  engine_process)
            engine, chat = launch.load_engine(checkpoint, config, device, n_threads, engine_process, weights)
        except (AstraiError, ValueError) as e:
            _fail(str(e))
    status = launch.serve(engine, chat, model_id, aliases, host=host, port=port, api_key=api_key,
                          allowed_hosts=allowed_host, device=device, threads=(n_threads, why), dtype_why=dtype_why,
                          reference=model,
                          look_up=alias_version, alias_poll=alias_poll)
    if status:
        raise typer.Exit(status)


@app.command("export-hf")
def export_hf(model: str = typer.Argument(..., help=f"The model: {REFERENCE_HELP}."),
              out: Path = typer.Argument(..., help="Directory to write: a new or empty one, or an earlier export "
                                          "(replaced); never inside or around the model's checkpoint."),
              force: bool = typer.Option(False, "--force", help="Replace OUT even if it holds other files.")) -> None:
    """Write MODEL as a Hugging Face model directory OUT (config.json, model.safetensors, tokenizer files,
    generation_config.json, README.md: the model card, a registered version's description) that transformers'
    AutoModelForCausalLM / AutoTokenizer load. Options with no matching transformers architecture are refused."""
    import tempfile

    from tasks.registry.model_card import card_of
    from tasks.registry.models import resolve_model
    from astrai_core.convert.hf import export_hf as export

    with tempfile.TemporaryDirectory(prefix="astrai-export-") as tmp:  # a registry download
        try:
            checkpoint = resolve_model(model, Path(tmp)).checkpoint
            path = export(checkpoint, out, force=force, readme=card_of(model, checkpoint))
        except AstraiError as e:
            _fail(str(e))
    print(f"wrote {path} ({json.loads((path / 'config.json').read_text())['architectures'][0]})")


@app.command("export-gguf")
def export_gguf(model: str = typer.Argument(..., help=f"The model: {REFERENCE_HELP}."),
                out: Path = typer.Argument(..., help="GGUF file to write: a new file, or an earlier export "
                                           "(replaced); never a file of the model's."),
                type_: str = typer.Option("f32", "--type", help="f32 (the checkpoint's numbers), q8_0 (8-bit "
                                          "blocks, about a quarter of the size) or bf16 (half the size: the weights "
                                          "`astrai serve --dtype bf16` computes with)."),
                force: bool = typer.Option(False, "--force", help="Replace OUT even if export-gguf did not write "
                                           "it.")) -> None:
    """Write MODEL as one GGUF file OUT that llama.cpp runs (llama-cli, llama-server, ...): weights, the tokenizer
    (with astrai's special tokens as control tokens) and the chat template. Options that llama.cpp's llama and
    arcee architectures do not compute are refused."""
    import tempfile

    from tasks.registry.models import resolve_model
    from astrai_core.convert.gguf_export import TYPES, export_gguf as export

    if type_ not in TYPES:
        _fail(f"--type {type_}: expected one of {', '.join(TYPES)}")
    with tempfile.TemporaryDirectory(prefix="astrai-gguf-") as tmp:  # a registry download, gone once written
        try:
            path = export(resolve_model(model, Path(tmp)).checkpoint, out, type_, force=force)
        except AstraiError as e:
            _fail(str(e))
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {type_})")


@app.command("import-hf")
def import_hf(hf_dir: Path = typer.Argument(..., help="A Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, "
                                            "...) or a GGUF file (llama architecture)."),
              out: Path = typer.Argument(..., help="Checkpoint directory to write: a new or empty one, or an earlier "
                                          "import (replaced); never inside or around HF_DIR."),
              force: bool = typer.Option(False, "--force", help="Replace OUT even if it holds other files.")) -> None:
    """Convert the Hugging Face model in HF_DIR (or a GGUF file) into an astrai checkpoint directory OUT, a starting
    point for any stage (safetensors weights and tokenizer.json needed; nothing is downloaded). A model with a chat
    template keeps its tokenizer, template and stop tokens as they are; to one without, astrai's special tokens that
    the tokenizer lacks are added (summary.json in OUT records them), growing vocab_size if needed."""
    from astrai_core.convert.gguf_import import import_model

    try:
        path = import_model(hf_dir, out, force=force)
    except AstraiError as e:
        _fail(str(e))
    report = json.loads((path / "summary.json").read_text())  # what import added to the HF tokenizer and model
    added, reused = (", ".join(f"{name}={i}" for name, i in sorted(report[key].items(), key=lambda kv: kv[1])) or "none"
                     for key in ("special_tokens_added", "special_tokens_reused"))
    vocab = report["vocab_size"]
    own = report.get("special_tokens")
    stops = f"\nits own special tokens (special_tokens.json): stops at {', '.join(own['stop'])}" if own else ""
    print(f"wrote {path}\nspecial tokens added: {added}; reused: {reused}\nvocab_size {vocab['hf']} -> "
          f"{vocab['astrai']} (rows of added tokens: the mean of the known vocabulary's rows){stops}")


@app.command("dvc-yaml")
def dvc_yaml(check: bool = typer.Option(False, "--check", help="Only say whether dvc.yaml is the table's (exit 2 "
                                        "when not).")) -> None:
    """Write dvc.yaml in this directory from the stage table (tasks/run/table.py): after adding or changing a stage
    there. `astrai pipeline` stops while dvc.yaml differs from the table's."""
    from tasks.run.schema import SECTIONS
    from tasks.run.table import check_dvc_yaml, check_own_dvc_yaml, check_table, dvc_yaml as text

    check_table(SECTIONS)  # an entry an edit left wrong: one line naming it, before anything is written
    path = Path("dvc.yaml")
    check_own_dvc_yaml(Path())  # another project's folder, or a dvc.yaml someone else wrote: one line, nothing written
    try:
        check_dvc_yaml(Path())
        typer.echo(f"{path}: the stage table's ({len(STAGES)} stages), unchanged")
        return
    except AstraiError as e:
        if check:
            _fail(str(e))
    tmp = path.with_name(f".dvc.yaml.{os.getpid()}")  # whole or not at all
    try:
        tmp.write_text(text())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        _fail(f"{path.resolve()}: cannot write it ({e.strerror or e})")
    typer.echo(f"{path}: written from the stage table, tasks/run/table.py ({len(STAGES)} stages)")


@app.command("profile-args")
def profile_args(
    name: str = typer.Argument(..., help="A profile: the name of a file in profiles/ (quick, finetune, gpu)."),
    set_: list[str] = typer.Option([], "--set", help="A param on top of the profile: KEY=VALUE with a dotted key, "
                                   "e.g. pretrain.init_from=MODEL for finetune. Repeatable."),
) -> None:
    """Print profiles/NAME.yaml (and its name, and --set) as DVC's -S options, for an experiment with a profile:
    `dvc exp run $(astrai profile-args quick) -n quick-try`. DVC writes an experiment's params into the workspace's
    params.yaml when it ends: `git checkout params.yaml` takes yours back."""
    from tasks.run.params import profile_overrides

    overrides = dict(_parse_override(s) for s in set_)
    print(" ".join(f"-S {override}" for override in profile_overrides(Path(), name, overrides)))


@app.command("lm-eval-data")
def lm_eval_data(corpus: Path = typer.Option(Path("data/corpus"), help="The corpus stage's output (its test.jsonl "
                                             "holds the held-out plays)."),
                 out: Path = typer.Option(Path("evals/lm_eval_tasks/data"), help="Where the task definitions in "
                                          "evals/lm_eval_tasks/ read their data."),
                 limit: int = typer.Option(500, min=1, help="Items per task at most."),
                 seed: int = typer.Option(0, help="Which items and which wrong choices."),
                 force: bool = typer.Option(False, "--force", help="Replace OUT even if lm-eval-data did not write "
                                            "it.")) -> None:
    """Write the JSONL of the lm-evaluation-harness tasks in evals/lm_eval_tasks/ (who speaks next, speech
    perplexity, the demo's task families as generate_until) from the held-out plays; then run lm_eval against
    `astrai serve` (docs/serving.md, "lm-evaluation-harness")."""
    from tasks.evaluation.lm_eval_data import FILES, write_lm_eval_data

    counts = write_lm_eval_data(corpus, out, limit, seed, force=force)
    for task, n in counts.items():
        print(f"{task}: {n} items -> {out / FILES[task]}")


@app.command()
def promote(source: str = typer.Argument(..., help="The version: models:/NAME@ALIAS or models:/NAME/VERSION."),
            to: str = typer.Option(..., "--to", help="The registered model to copy it to, e.g. astrai-prod."),
            alias: str = typer.Option("champion", help="The target's alias to move to the copy."),
            force: bool = typer.Option(False, "--force", help="Promote even if it does not beat the target's "
                                       "alias on the register gate.")) -> None:
    """Copy a registered version to another registered model (MLflow's copy_model_version) with its lineage tags and
    who promoted it from where, and move the target's alias to it: refused unless it beats the version that alias
    points to on the register stage's gate (or --force). Serve it with `astrai serve --model models:/TARGET@ALIAS`."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.registry.lock import registry_lock_uri
    from tasks.registry.models import use_tracking_store
    from tasks.registry.promote import promote as run

    # A tracking server that accepts and does not answer (its database down) held each request for MLflow's default
    # 120 s, tried 7 times (astrai_core/runtime/env.defaults): promote's requests are small (versions, tags, the gate's
    # items as one JSON), so 15 s each bounds the whole wait at about 3 minutes, the retries for a
    # restarting server kept.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    params = use_tracking_store()
    try:
        print(run(mlflow.MlflowClient(), source, to, alias, force, registry_lock_uri(params)))
    except AstraiError as e:
        _fail(str(e))
    except MlflowException as e:  # the registry failed, or did not answer past MLflow's retries: its line names it
        _fail(str(e.message).strip().splitlines()[0])


services_app = typer.Typer(help="The team services: PostgreSQL, the MLflow and Prefect servers on it, a process "
                             "worker (docs/scaling-out.md, Team setup).", no_args_is_help=True)
app.add_typer(services_app, name="services")


@services_app.command("start")
def services_start(
    directory: str = typer.Argument(..., help="Where the services keep their state, logs and artifacts: a new or empty "
                                    "folder, or one `astrai services start` used before."),
    postgres: Optional[str] = typer.Option(None, help="A running PostgreSQL (postgresql://USER:PASSWORD@HOST:PORT) "
                                           "where USER may create databases; default: a trial one in DIR/postgres."),
    host: str = typer.Option("127.0.0.1", help="Address the servers listen on (0.0.0.0: every interface, for "
                             "compute nodes; nothing here authenticates, so a trusted network only)."),
    pg_port: int = typer.Option(5432, help="Port of the trial PostgreSQL."),
    mlflow_port: int = typer.Option(5000, help="Port of the MLflow tracking server."),
    prefect_port: int = typer.Option(4200, help="Port of the Prefect server."),
    pool: str = typer.Option("astrai-local", help="The process work pool the worker serves (prefect.yaml's)."),
) -> None:
    """Start PostgreSQL (or use --postgres), the MLflow server with proxied artifacts, the Prefect server, a process
    work pool and its worker; print the settings a checkout needs."""
    from astrai import services

    if not directory.strip():  # Path("") is the current directory
        _fail("DIR '': give the folder the services keep their state in")
    try:
        state = services.start(Path(directory), host, postgres, pg_port, mlflow_port, prefect_port, pool)
    except AstraiError as e:
        _fail(str(e))
    typer.echo(f"MLflow: {state['mlflow_url']}  Prefect: {state['prefect_api_url'].removesuffix('/api')}  "
               f"pool: {state['pool']}  (stop: astrai services stop {directory})", err=True)
    _print_env(services.client_env(state))


@services_app.command("env")
def services_env(directory: Path = typer.Argument(..., help="The directory given to `astrai services start`.")) -> None:
    """Print the settings that point a shell at the services: eval "$(astrai services env DIR)"."""
    from astrai import services

    try:
        _print_env(services.running_env(directory))
    except AstraiError as e:
        _fail(str(e))


def _print_env(env: dict[str, str]) -> None:
    import shlex

    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


@services_app.command("stop")
def services_stop(directory: Path = typer.Argument(..., help="The directory given to `astrai services start`.")) -> None:
    """Stop the worker, the servers and the trial PostgreSQL (its data stays; start again reuses it)."""
    from astrai import services

    try:
        services.stop(directory)
    except AstraiError as e:
        _fail(str(e))
    typer.echo("stopped", err=True)


def main() -> None:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer 0.29 carries its own click

    # A stage's progress lines (and a Slurm job's, which it relays) reach a pipe, a tee or a log as they happen,
    # not in 8 KiB blocks: Ctrl-C and the eta then refer to what the reader has seen.
    sys.stdout.reconfigure(line_buffering=True)
    try:
        # Not standalone: a usage error (`--limit abc`) reaches the line below instead of click's framed box.
        code = app(standalone_mode=False)
    except NoArgsIsHelpError:  # the help was printed
        sys.exit(2)
    except UsageError as e:
        where = f" (astrai {e.ctx.command_path.partition(' ')[2]} --help)".replace("  ", " ") if e.ctx else ""
        typer.echo(f"astrai: error: {e.format_message()}{where}", err=True)
        sys.exit(2)
    except typer.Abort:  # Ctrl-C at a prompt
        sys.exit(130)
    except (KeyboardInterrupt, Interrupted):  # Ctrl-C: on the way here what the command started was stopped
        typer.echo("astrai: interrupted (SIGINT); what it had started is stopped (a pipeline: its flow run is "
                   "Cancelled, finished stages are kept)", err=True)
        sys.exit(130)
    except AstraiError as e:
        typer.echo(f"astrai: error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - a bug: one line naming where, the traceback in a log file
        if isinstance(e, OSError) and e.filename:
            # A folder that cannot be written, a full disk: the file it names is the user's to fix, not a bug (and
            # atomic_path left nothing half-written there).
            typer.echo(f"astrai: error: {e.filename}: {e.strerror or e}", err=True)
            sys.exit(2)
        import time

        log = log_file(Path(), f"astrai-{time.strftime('%Y%m%d-%H%M%S')}")
        typer.echo(f"astrai: error: {crash_line(e, log)}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(code) comes back as its code


if __name__ == "__main__":
    main()
