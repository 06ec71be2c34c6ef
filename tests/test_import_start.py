"""`astrai import-hf` gives a starting point for any stage: the imported tokenizer gains astrai's special tokens
(the model grows to embed them, the logits of the original vocabulary unchanged), pretraining starts from the
imported weights (`pretrain.init_from`) on data packed with that tokenizer (the tokenizer stage copies it), and the trained
model exports back to Hugging Face. Randomly initialized tiny `transformers` models; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
transformers = pytest.importorskip("transformers")

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402
from astrai_core.convert.hf import export_hf, import_hf  # noqa: E402
from astrai_core.inference.generate import generate  # noqa: E402
from astrai_core.runtime.errors import AstraiError  # noqa: E402
from astrai_core.runtime.io import sha256_file  # noqa: E402
from astrai_core.tokenizer.bpe import SPECIAL_TOKENS, load_tokenizer  # noqa: E402
from astrai_core.tokenizer.chat import load_chat  # noqa: E402

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6)
TEXT = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ")
# name -> (the tokenizer's own special tokens, extra embedding rows beyond the tokenizer, transformers config)
MODELS = {
    # Llama-3 names its bos/eos as astrai does: reused; untied, the embedding exactly the tokenizer's size.
    "llama": (["<|begin_of_text|>", "<|end_of_text|>"], 0,
              lambda v: transformers.LlamaConfig(**SHAPE, vocab_size=v, tie_word_embeddings=False, bos_token_id=0,
                                                 eos_token_id=1)),
    # Qwen's tokens are all new; tied, with 3 padding rows after the tokenizer (Qwen pads its embedding).
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 3,
              lambda v: transformers.Qwen3Config(**SHAPE, vocab_size=v, head_dim=16, tie_word_embeddings=True,
                                                 eos_token_id=0)),
}


def hf_tokenizer(specials: list[str]):
    """A byte-level BPE as Llama-3 and Qwen have, with `specials` and none of astrai's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    return tok


def save_hf(tmp_path, name: str):
    """(transformers model, its directory, the tokenizer's size): random weights, tokenizer by save_pretrained."""
    specials, padding, config = MODELS[name]
    tok = hf_tokenizer(specials)
    n_tok = tok.get_vocab_size()
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config(n_tok + padding), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norm gains away from 1
        hf_model.get_input_embeddings().weight[n_tok:] = 0  # padding rows are never trained
    hf_dir = tmp_path / f"hf_{name}"
    hf_model.save_pretrained(hf_dir)
    eos = "<|end_of_text|>" if name == "llama" else "<|endoftext|>"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos,
                                        clean_up_tokenization_spaces=False).save_pretrained(hf_dir)
    return hf_model, hf_dir, n_tok


@pytest.mark.parametrize("name", MODELS)
def test_import_adds_special_tokens_and_keeps_the_logits(tmp_path, name):
    hf_model, hf_dir, n_tok = save_hf(tmp_path, name)
    ckpt = import_hf(hf_dir, tmp_path / "ckpt")
    report = json.loads((ckpt / "summary.json").read_text())
    reused = {"bos": 0, "eos": 1} if name == "llama" else {}
    added = {n: n_tok + i for i, n in enumerate(n for n in SPECIAL_TOKENS if n not in reused)}
    assert report["special_tokens_added"] == added
    assert report["special_tokens_reused"] == reused
    assert report["vocab_size"] == {"hf": hf_model.config.vocab_size, "astrai": n_tok + len(added)}

    # The stages' tokenizer checks pass, and the chat format encodes with the new special tokens.
    tok = load_tokenizer(ckpt / "tokenizer.json")
    ids, mask = load_chat(ckpt / "tokenizer.json").encode([{"role": "user", "content": "Who is the sun?"},
                                                          {"role": "assistant", "content": "Juliet"}])
    assert ids[0] == tok.token_to_id("<|user|>") == added["user"] and ids[-1] == added["end_of_turn"]
    assert tok.encode("O Romeo").ids == transformers.AutoTokenizer.from_pretrained(hf_dir).encode("O Romeo")

    model, _, cfg = load_model(ckpt)
    assert cfg.vocab_size == n_tok + len(added) and cfg.tie_embeddings == (name == "qwen3")
    torch.manual_seed(2)
    x = torch.randint(0, n_tok, (2, 40))
    with torch.no_grad():
        ours, theirs = model(x), hf_model(x).logits
    assert (ours[..., :n_tok] - theirs[..., :n_tok]).abs().max().item() < 1e-4  # the original vocabulary
    # A new token's row is the mean of the known ones: its logit is the mean known logit (never a greedy pick).
    torch.testing.assert_close(ours[..., added["pad"]], ours[..., :n_tok].mean(-1), atol=1e-4, rtol=1e-4)
    known = hf_model.get_input_embeddings().weight[:n_tok].mean(0)
    torch.testing.assert_close(model.embed_tokens.weight[added["user"]], known, atol=1e-6, rtol=1e-6)
    prompt = [5, 17, 42, 9]
    hf_model.generation_config.eos_token_id = None  # compare all 12 tokens
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == generate(model, prompt, 12)


def test_import_of_a_tokenizer_with_every_special_token_copies_it(tmp_path):
    """Nothing to add: the tokenizer file and vocab_size stay exactly the HF model's."""
    from astrai_core.tokenizer.bpe import train_tokenizer

    tok = train_tokenizer([TEXT] * 20, vocab_size=300)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SHAPE, vocab_size=tok.get_vocab_size()), dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    report = json.loads((ckpt / "summary.json").read_text())
    assert report["special_tokens_added"] == {} and report["mean_initialized_rows"] == []
    assert report["vocab_size"] == {"hf": tok.get_vocab_size(), "astrai": tok.get_vocab_size()}
    assert (ckpt / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


def test_cli_import_prints_what_was_added(tmp_path):
    from typer.testing import CliRunner

    from astrai.cli import app

    _, hf_dir, n_tok = save_hf(tmp_path, "llama")
    result = CliRunner().invoke(app, ["import-hf", str(hf_dir), str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert f"special tokens added: pad={n_tok}, system={n_tok + 1}" in result.output
    assert "reused: bos=0, eos=1" in result.output and f"vocab_size {n_tok} -> {n_tok + 5}" in result.output


def pack(tok, path, sha: str) -> str:
    from astrai_core.data.packed import PackedWriter
    from astrai_core.tokenizer.bpe import special_id

    with PackedWriter(path, vocab_size=tok.get_vocab_size(), tokenizer_sha256=sha, source_manifest_sha256="test",
                      split="train") as w:
        for sentence in TEXT.split(". ") * 10:
            w.add_document(tok.encode(sentence, add_special_tokens=False).ids + [special_id(tok, "eos")])
    return str(path)


def test_imported_checkpoint_starts_pretraining_and_exports_back(tmp_path, monkeypatch):
    from astrai_core.model.config import ModelConfig
    from astrai_core.training.train import train
    from tasks.run.configs import train_config
    from tasks.run.schema import Params
    from tasks.stages.tokenizer import copy_tokenizer

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    _, hf_dir, _ = save_hf(tmp_path, "llama")
    ckpt = import_hf(hf_dir, tmp_path / "ckpt")
    model_cfg = json.loads((ckpt / "config.json").read_text())
    # The pipeline's wiring: with pretrain.init_from the tokenizer stage copies the checkpoint's tokenizer
    # (tasks/stages/runner.py), pretrain starts from it.
    params = Params(model=model_cfg,
                    pretrain={"init_from": str(ckpt), "seq_len": 32, "batch_size": 2, "max_steps": 1, "device": "cpu",
                              "dtype": "fp32", "log_every": 1, "optim": {"lr": 1e-12, "min_lr": 0.0, "warmup_steps": 0,
                                                                         "weight_decay": 0.0}})
    tok_path = copy_tokenizer(str(ckpt), tmp_path / "tokenizer")
    tok = load_tokenizer(tok_path)
    (tmp_path / "packed").mkdir()
    pack(tok, tmp_path / "packed" / "train.h5", sha256_file(tok_path))
    cfg = train_config(params, "pretrain", tmp_path).model_copy(update={
        "train_data": str(tmp_path / "packed" / "train.h5"), "val_data": None, "tokenizer": str(tok_path),
        "out_dir": str(tmp_path / "start")})
    assert cfg.init_from == str(ckpt) and cfg.model == ModelConfig(**model_cfg)

    # One step with lr 1e-12: the run's weights are the imported ones.
    train(cfg)
    start, _, _ = load_model(tmp_path / "start")
    imported, _, _ = load_model(ckpt)
    for key in ("embed_tokens.weight", "lm_head.weight", "layers.1.mlp.down_proj.weight"):
        torch.testing.assert_close(start.state_dict()[key], imported.state_dict()[key], atol=1e-8, rtol=0)

    # A real run from there finishes, and its checkpoint exports back to an equivalent transformers model.
    cfg = cfg.model_copy(update={"out_dir": str(tmp_path / "trained"), "max_steps": 4,
                                 "optim": cfg.optim.model_copy(update={"lr": 1e-2})})
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["final_train_loss"] < 10
    trained, _, _ = load_model(tmp_path / "trained")
    assert not torch.equal(trained.layers[1].mlp.down_proj.weight, imported.layers[1].mlp.down_proj.weight)
    out = export_hf(tmp_path / "trained", tmp_path / "hf_again")
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.randint(0, tok.get_vocab_size(), (1, 24))
    with torch.no_grad():
        assert (again(x).logits - trained(x)).abs().max().item() < 1e-4
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == tok.get_vocab_size()


def test_tokenizer_source_copies_exactly_or_fails_naming_the_key(tmp_path):
    from tasks.run.schema import Params, TokenizerParams
    from tasks.stages.tokenizer import build_tokenizer, check_vocab_size

    _, hf_dir, n_tok = save_hf(tmp_path, "llama")
    ckpt = import_hf(hf_dir, tmp_path / "ckpt")
    for source in (ckpt, ckpt / "tokenizer.json"):  # a checkpoint directory or the file itself
        path = build_tokenizer(TokenizerParams(source=str(source)), tmp_path / "no_corpus", tmp_path / "tok")
        assert path.read_bytes() == (ckpt / "tokenizer.json").read_bytes()
        assert (path.parent / "chat_template.jinja").is_file()
    # model.vocab_size is checked against the copied tokenizer's real size, not tokenizer.vocab_size (unused).
    Params(tokenizer={"source": str(ckpt), "vocab_size": 4096}, model={"vocab_size": n_tok + 5})
    check_vocab_size(path, n_tok + 5)
    with pytest.raises(AstraiError, match=rf"model.vocab_size \({n_tok}\) must be >= .*\({n_tok + 5}\)"):
        check_vocab_size(path, n_tok)

    for bad, why in ((tmp_path / "missing", "not found"), (hf_dir, r"lacks the special token <\|pad\|>")):
        with pytest.raises(AstraiError, match=f"^tokenizer.source: .*{why}") as e:
            build_tokenizer(TokenizerParams(source=str(bad)), tmp_path / "no_corpus", tmp_path / "tok2")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "tok2").exists()


def test_params_yaml_defaults_keep_todays_behaviour():
    from pathlib import Path

    from tasks.run.params import load_params

    import yaml

    from astrai_core.training.config import GRPOConfig

    path = Path(__file__).resolve().parents[1] / "params.yaml"
    params = load_params(path)
    assert params.tokenizer.source == "train" and params.pretrain.init_from is None
    # GRPO's DAPO / Dr. GRPO options are written out (dvc params diff shows a change) and off: the core's defaults.
    options = ("clip_eps_high", "scale_rewards", "oversample")
    written = yaml.safe_load(path.read_text())["grpo"]["objective"]
    assert [written[k] for k in options] == [getattr(GRPOConfig(), k) for k in options] == [None, True, 1]
