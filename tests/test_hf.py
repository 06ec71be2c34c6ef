"""Hugging Face interop: export and import with numerical parity against randomly initialized `transformers`
models (nothing is downloaded). Logits within 1e-4 in fp32 and identical greedy continuations, both directions."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only; without it Llama loading probes the hub
transformers = pytest.importorskip("transformers")

from astrai_core.checkpoint.model_dir import load_model, save_checkpoint  # noqa: E402
from astrai_core.convert.hf import export_hf, hf_model_type, import_hf  # noqa: E402
from astrai_core.inference.generate import generate  # noqa: E402
from astrai_core.model.config import ModelConfig  # noqa: E402
from astrai_core.model.transformer import Transformer  # noqa: E402
from astrai_core.runtime.errors import AstraiError  # noqa: E402

TINY = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
MLA = dict(attention="mla", mla_kv_rank=16, mla_rope_dim=8)

# Every exportable option: name -> (ModelConfig overrides, the transformers class it must load as).
EXPORTS = {
    "llama": ({}, "LlamaForCausalLM"),
    "llama_mqa_untied": (dict(n_kv_heads=1, tie_embeddings=False), "LlamaForCausalLM"),
    "llama_mha": (dict(n_kv_heads=4), "LlamaForCausalLM"),
    "llama_rope_linear": (dict(rope_scaling="linear", rope_factor=2.0, rope_theta=500.0), "LlamaForCausalLM"),
    "llama_rope_ntk": (dict(rope_scaling="ntk", rope_factor=4.0, rope_theta=500.0), "LlamaForCausalLM"),
    "qwen2_qkv_bias": (dict(qkv_bias=True), "Qwen2ForCausalLM"),
    "qwen3_qk_norm": (dict(qk_norm=True, attn_head_dim=16), "Qwen3ForCausalLM"),
    "qwen3_moe": (dict(qk_norm=True, n_experts=4, moe_top_k=2, moe_ffn_dim=32), "Qwen3MoeForCausalLM"),
    "deepseek_v2_mla": (MLA, "DeepseekV2ForCausalLM"),
    "deepseek_v2_mla_moe": (dict(**MLA, n_experts=4, n_shared_experts=1, moe_ffn_dim=32), "DeepseekV2ForCausalLM"),
    "arcee_relu2": (dict(mlp="relu2", tie_embeddings=False), "ArceeForCausalLM"),
    "llama_zero_init_out": (dict(zero_init_out=True), "LlamaForCausalLM"),  # only an init: a plain Llama
}


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """An astrai tokenizer (with the special tokens) trained on mixed-script text."""
    from astrai_core.tokenizer.bpe import train_tokenizer

    texts = ["ROMEO.\nBut soft, what light through yonder window breaks?\n", "  spaces\tand tabs\n\n",
             "中文测试：你好，世界。", "Emoji 👍🏽 and café, naïve."]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(texts * 20, vocab_size=300, min_frequency=2).save(str(path))
    return path


def random_astrai(**kw) -> Transformer:
    """A tiny model with every parameter perturbed, so norm gains and biases are not the trivial 1 and 0."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **kw}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def perturbed(hf_model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf_model.eval()


def assert_parity(ours: Transformer, hf_model) -> float:
    """Max |logit difference| on random ids (< 1e-4) and identical 12-token greedy continuations."""
    torch.manual_seed(2)
    x = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        err = (ours(x) - hf_model(x).logits).abs().max().item()
    assert err < 1e-4, err
    prompt = [5, 17, 42, 9]
    hf_model.generation_config.eos_token_id = None  # compare the full 12 tokens; astrai generate has no stop here
    hf_out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert hf_out[0, len(prompt):].tolist() == generate(ours, prompt, 12)
    return err


@pytest.mark.parametrize("name", EXPORTS)
def test_export_loads_in_transformers_with_parity(tmp_path, tokenizer_path, name):
    overrides, architecture = EXPORTS[name]
    model = random_astrai(**overrides)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    out = export_hf(ckpt, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf_model).__name__ == architecture
    assert_parity(model, hf_model)


def test_exported_tokenizer_encodes_decodes_identically(tmp_path, tokenizer_path):
    from tokenizers import Tokenizer

    model = random_astrai()
    out = export_hf(save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path), tmp_path / "hf")
    ours, theirs = Tokenizer.from_file(str(tokenizer_path)), transformers.AutoTokenizer.from_pretrained(out)
    for text in ["ROMEO.\nBut soft!", "  leading spaces\tand tabs\n\n", "中文测试：你好", "👍🏽 café",
                 "<|user|>hi<|end_of_turn|>", ""]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs(text)["input_ids"] == ours.encode(text).ids  # no BOS added by either
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)  # the defaults differ, not the text
    assert theirs.eos_token == "<|end_of_text|>" and theirs.bos_token == "<|begin_of_text|>"
    chat = theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi<|end_of_turn|><|assistant|>"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False and ours.token_to_id("<|end_of_text|>") in gen["eos_token_id"]


@pytest.mark.parametrize("overrides, reason", [
    (dict(attn_gate=True), "attn_gate"),
    (dict(n_experts=4, n_shared_experts=1), "shared experts"),
    (dict(n_experts=4), "qk_norm"),
    (dict(qk_norm=True, qkv_bias=True), "qkv_bias"),
    (dict(**MLA, n_experts=4), "n_shared_experts"),
    (dict(logit_softcap=30.0), "model.logit_softcap"),
    (dict(value_embeds=True), "model.value_embeds"),
    (dict(x0_scalars=True), "model.x0_scalars"),
    (dict(mlp="relu2", qk_norm=True), "model.mlp 'relu2' with"),
])
def test_options_without_an_hf_architecture_are_refused(tmp_path, tokenizer_path, overrides, reason):
    model = random_astrai(**overrides)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    with pytest.raises(AstraiError, match=f"cannot export.*{reason}"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- import: random transformers models -> astrai checkpoints ----

HF_SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
IMPORTS = {
    "llama": lambda: transformers.LlamaConfig(**HF_SHAPE, tie_word_embeddings=False, rope_theta=5000.0),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **HF_SHAPE, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "mistral": lambda: transformers.MistralConfig(**{**HF_SHAPE, "max_position_embeddings": 128}, sliding_window=64),
    "arcee": lambda: transformers.ArceeConfig(**HF_SHAPE, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**HF_SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**HF_SHAPE, head_dim=16, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**HF_SHAPE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=False),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**HF_SHAPE, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=0),
    "deepseek_v2_dense": lambda: transformers.DeepseekV2Config(
        **{**HF_SHAPE, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=2, tie_word_embeddings=True),
}


def save_hf(tmp_path, tokenizer_path, config):
    config.bos_token_id, config.eos_token_id = 0, 1  # its tokenizer's <|begin_of_text|>, <|end_of_text|>
    torch.manual_seed(0)
    hf_model = perturbed(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), eos_token="<|end_of_text|>",
                                               clean_up_tokenization_spaces=False)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(hf_dir)
    return hf_model, hf_dir


@pytest.mark.parametrize("name", IMPORTS)
def test_import_from_transformers_with_parity(tmp_path, tokenizer_path, name):
    hf_model, hf_dir = save_hf(tmp_path, tokenizer_path, IMPORTS[name]())
    ckpt = import_hf(hf_dir, tmp_path / "ckpt")
    model, tok, cfg = load_model(ckpt)
    if name == "qwen2":
        assert cfg.qkv_bias and model.layers[0].self_attn.q_proj.bias is not None
    if name == "mistral":
        assert cfg.max_seq_len == 64  # capped at the sliding window: exact up to there
    eos = hf_model.generation_config.eos_token_id
    assert_parity(model, hf_model)
    hf_model.generation_config.eos_token_id = eos
    # The tokenizer and chat template travel along; exporting again gives back an equivalent HF model.
    assert tok.encode("But soft!").ids == transformers.AutoTokenizer.from_pretrained(hf_dir).encode("But soft!")
    if hf_model_type(cfg) == json.loads((hf_dir / "config.json").read_text())["model_type"]:
        again = export_hf(ckpt, tmp_path / "again")
        assert_parity(model, transformers.AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32))
        assert transformers.AutoTokenizer.from_pretrained(again).chat_template.startswith("{% for m in messages")
        assert json.loads((again / "config.json").read_text())["eos_token_id"] == hf_model.generation_config.eos_token_id


def test_import_refuses_unsupported_configs(tmp_path, tokenizer_path):
    config = transformers.LlamaConfig(**HF_SHAPE, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    _, hf_dir = save_hf(tmp_path, tokenizer_path, config)
    with pytest.raises(AstraiError, match="rope type 'llama3'"):
        import_hf(hf_dir, tmp_path / "ckpt")
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(AstraiError, match="model_type 'gpt2' is not supported"):
        import_hf(hf_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_cli_export_and_import(tmp_path, tokenizer_path):
    from typer.testing import CliRunner

    from astrai.cli import app

    model = random_astrai()
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.cfg, tokenizer_path)
    runner = CliRunner()
    result = runner.invoke(app, ["export-hf", str(ckpt), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.output
    result = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    back, _, cfg = load_model(tmp_path / "back")
    assert cfg.model_dump() == {**model.cfg.model_dump(), "ffn_dim": model.cfg.hidden_dim}  # the rule, resolved
    x = torch.randint(0, 300, (1, 16))
    torch.testing.assert_close(back(x), model(x), atol=0, rtol=0)
    gated = random_astrai(attn_gate=True)
    ckpt = save_checkpoint(tmp_path / "gated", gated, gated.cfg, tokenizer_path)
    result = runner.invoke(app, ["export-hf", str(ckpt), str(tmp_path / "hf2")])
    assert result.exit_code == 2 and "attn_gate" in result.output


def test_pipeline_trained_model_registered_with_hf_export_generates_the_same_text(tmp_path, tiny_trained,
                                                                                   monkeypatch):
    """Done means: a model trained by the training core, registered, loads from the registry in transformers and
    generates the same greedy text as the registered pyfunc model (what `astrai generate --model models:/...` runs)."""
    import mlflow

    import shutil

    from tasks.run.schema import Params
    from tasks.stages.register import register

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    shutil.copytree(tiny_trained, tmp_path / "data" / "pretrain")
    (tmp_path / "metrics.json").write_text(json.dumps({"pretrain/task_accuracy": 0.5}))
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        exp = mlflow.create_experiment("hf", artifact_location=(tmp_path / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=exp):
            result = register(Params(register={"model_name": "hf_test"}), tmp_path / "metrics.json",
                              tmp_path / "register", tmp_path)
        assert result["tags"]["hf_export"] == "Qwen3ForCausalLM"
        local = mlflow.artifacts.download_artifacts("models:/hf_test@champion", dst_path=str(tmp_path / "dl"))
        description = mlflow.MlflowClient().get_model_version("hf_test", "1").description
        model_description = mlflow.MlflowClient().get_registered_model("hf_test").description
        pyfunc_text = mlflow.pyfunc.load_model("models:/hf_test@champion").predict(
            ["the king"], params={"max_new_tokens": 12, "temperature": 0.0})[0]
    finally:
        mlflow.set_tracking_uri(previous)
    hf_dir = f"{local}/artifacts/hf"
    # The export carries the version's card as its README.md, the same text as the version's description.
    readme = open(f"{hf_dir}/README.md").read()
    assert readme.startswith("# hf_test version 1\n") and readme == description
    assert "astrai serve --model models:/hf_test/1" in readme
    # Issue 43, item 16: the registered model has a description too, and the card's "Use it" block reads without
    # scrolling in MLflow's description box (no line over 80 characters there).
    assert model_description.startswith("Small GPT-style language models trained by the AstrAI pipeline")
    use_it = readme.split("## Use it", 1)[1]
    assert max(len(line) for line in use_it.splitlines()) <= 80, use_it
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf_model.generation_config.eos_token_id = None
    prompt = hf_tok("the king", return_tensors="pt")["input_ids"]
    out = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert hf_tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True) == pyfunc_text
    assert len(pyfunc_text) > 0
