"""A published model stays itself (issue 49): a tiny random Llama with a ChatML template and its own end of turn,
built here as a Hugging Face folder and as a GGUF file the `gguf` package writes, is imported with nothing added
(its tokenizer byte for byte, its stop ids its own), generates, serves over both HTTP APIs and exports back,
stopping where it stops; its template masks the assistant's turns only. Nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402
from astrai_core.convert.gguf_import import import_gguf  # noqa: E402
from astrai_core.convert.hf import export_hf, import_hf  # noqa: E402
from astrai_core.inference.generate import generate  # noqa: E402
from astrai_core.runtime.errors import AstraiError  # noqa: E402
from astrai_core.tokenizer.bpe import SPECIALS_FILE, load_tokenizer  # noqa: E402
from astrai_core.tokenizer.chat import load_chat  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
TEXT = ("The capital of France is Paris. The capital of Italy is Rome. What is the capital of Spain? Madrid. "
        "Is the sky blue? Yes. Is grass red? No. ") * 20
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 24


def chatml_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(transformers model, its folder): untied, eos <|im_end|> in generation_config.json as a list, the ChatML
    template in tokenizer_config.json; the head's <|im_end|> row made to win a few tokens into a reply, so that
    greedy replies end with it."""
    root = tmp_path_factory.mktemp("published")
    tok = chatml_tokenizer()
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        prompt = tok.encode(CHATML_PROMPT(), add_special_tokens=False).ids
        out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                             pad_token_id=2)
        model.lm_head.weight[2] = 4 * model.lm_head.weight[out[0, -1]]  # <|im_end|> where the 4th token would be
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    model.generation_config.eos_token_id = [2]
    model.generation_config.save_pretrained(hf_dir)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", chat_template=CHATML,
                                        clean_up_tokenization_spaces=False).save_pretrained(hf_dir)
    return model, hf_dir


def CHATML_PROMPT() -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True).from_string(CHATML).render(
        messages=QUESTION, add_generation_prompt=True)


def hf_reply(model, prompt: list[int]) -> list[int]:
    """transformers' greedy reply, stopping at the model's own eos (generation_config.json)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def imported(published, tmp_path_factory):
    return import_hf(published[1], tmp_path_factory.mktemp("imported") / "ckpt")


def test_import_adds_nothing_and_keeps_its_own_stop(published, imported):
    hf_model, hf_dir = published
    assert (imported / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    report = json.loads((imported / "summary.json").read_text())
    assert report["special_tokens_added"] == {} and report["mean_initialized_rows"] == []
    assert report["vocab_size"]["astrai"] == hf_model.config.vocab_size
    assert json.loads((imported / SPECIALS_FILE).read_text()) == {
        "bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|im_end|>", "stop": ["<|im_end|>"]}
    chat = load_chat(imported / "tokenizer.json")
    assert chat.stop_ids == (2,) and chat.template_text == CHATML
    assert load_tokenizer(imported / "tokenizer.json").get_vocab_size() == hf_model.config.vocab_size


def test_logits_and_greedy_reply_equal_transformers_and_stop_at_its_eos(published, imported):
    hf_model, _ = published
    model, _, _ = load_model(imported)
    chat = load_chat(imported / "tokenizer.json")
    prompt = chat.encode_prompt(QUESTION)
    x = torch.tensor([prompt])
    with torch.no_grad():
        assert (model(x) - hf_model(x).logits).abs().max().item() < 1e-4
        theirs = hf_reply(hf_model, prompt)
    ours = generate(model, prompt, MAX_NEW, stop_ids=chat.stop_ids)
    assert ours == theirs and ours[-1] == 2 and len(ours) < MAX_NEW, (ours, theirs)
    assert "<|im_end|>" not in chat.decode_reply(ours)


def test_the_template_masks_the_assistants_turns_only(imported):
    chat = load_chat(imported / "tokenizer.json")
    ids, mask = chat.encode([*QUESTION, {"role": "assistant", "content": "Paris."},
                             {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Rome."}])
    trained = chat.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    assert chat.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nYou are a helpful")


def test_gguf_file_imports_to_the_same_model(published, imported, tmp_path):
    """The gguf package writes the model (export-gguf: f32, and q8_0); import takes the file back: the same logits
    (f32) or close (q8_0), the same template and stop, nothing added."""
    from astrai_core.convert.gguf_export import export_gguf

    hf_model, _ = published
    model, _, _ = load_model(imported)
    x = torch.tensor([load_chat(imported / "tokenizer.json").encode_prompt(QUESTION)])
    with torch.no_grad():
        want = model(x)
    for kind, tol in (("f32", 1e-4), ("q8_0", 0.2)):
        gguf_file = export_gguf(imported, tmp_path / f"m-{kind}.gguf", kind)
        back = import_gguf(gguf_file, tmp_path / f"back-{kind}")
        chat = load_chat(back / "tokenizer.json")
        assert chat.stop_ids == (2,) and chat.template_text == CHATML
        assert json.loads((back / "summary.json").read_text())["special_tokens_added"] == {}
        again, _, _ = load_model(back)
        with torch.no_grad():
            assert (again(x) - want).abs().max().item() < tol, kind
    assert chat.tokenizer.encode(TEXT[:200]).ids == model_tokenizer(imported).encode(TEXT[:200]).ids


def model_tokenizer(ckpt: Path):
    return load_tokenizer(ckpt / "tokenizer.json")


def test_export_round_trip_keeps_the_model_itself(published, imported, tmp_path):
    out = export_hf(imported, tmp_path / "export")
    assert (out / "tokenizer.json").read_bytes() == (published[1] / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == CHATML_PROMPT()
    prompt = tok.encode(CHATML_PROMPT(), add_special_tokens=False)
    with torch.no_grad():
        assert hf_reply(back, prompt) == hf_reply(published[0], prompt)


def test_served_over_both_apis_stops_at_its_eos(published, imported, tmp_path):
    """`astrai serve` with no sizing option; the official openai and anthropic clients; a completion of the chat
    prompt stops at the end of turn too."""
    import anthropic
    import openai

    from conftest import start_serve, stop_group

    model, _, _ = load_model(imported)
    chat = load_chat(imported / "tokenizer.json")
    prompt = chat.encode_prompt(QUESTION)
    want = chat.decode_reply(generate(model, prompt, MAX_NEW, stop_ids=chat.stop_ids))
    proc, url = start_serve(imported, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="ckpt", messages=QUESTION, max_tokens=MAX_NEW, temperature=0)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (want, "stop")
        text = client.completions.create(model="ckpt", prompt=CHATML_PROMPT(), max_tokens=MAX_NEW, temperature=0)
        assert (text.choices[0].text, text.choices[0].finish_reason) == (want, "stop")
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
        message = claude.messages.create(model="ckpt", messages=QUESTION, max_tokens=MAX_NEW,
                                         extra_body={"temperature": 0})
        assert (message.content[0].text, message.stop_reason) == (want, "end_turn")
    finally:
        stop_group(proc)
    assert "KV blocks" in (tmp_path / "serve.log").read_text()


def test_bad_published_models_are_one_line(published, tmp_path):
    import shutil

    _, hf_dir = published
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [99999]}))
    with pytest.raises(AstraiError, match=r"generation_config.json: .*eos_token_id 99999 is not a token"):
        import_hf(bad, tmp_path / "out1")
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    config = json.loads((bad / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages|reverse %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    (bad / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(AstraiError, match=r"chat template: .*prefix"):
        import_hf(bad, tmp_path / "out2")
    from astrai_core.convert.gguf_export import export_gguf

    whole = export_gguf(import_hf(hf_dir, tmp_path / "good"), tmp_path / "whole.gguf")
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(AstraiError, match=rf"^{truncated}: cannot import this GGUF file: not a readable GGUF file"):
        import_gguf(truncated, tmp_path / "out3")
    empty = tmp_path / "e.gguf"
    empty.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)  # a header, no metadata
    with pytest.raises(AstraiError, match=rf"^{empty}: cannot import this GGUF file: no general.architecture"):
        import_gguf(empty, tmp_path / "out4")
    assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3, 4))


def test_llama_cpp_greedy_reply_equals_ours_and_stops_at_its_eos(imported, tmp_path):
    """The model as an f32 GGUF file (export-gguf writes its template and eos): llama.cpp's greedy reply to the chat
    prompt, stopping at its end of generation (<|im_end|>), is ours, byte for byte."""
    from test_gguf import llama_cpp_bin, llama_greedy, token_bytes

    from astrai_core.convert.gguf_export import export_gguf

    bin_dir = llama_cpp_bin()
    if bin_dir is None:
        why = "llama.cpp is not built: run scripts/build_llama_cpp.sh"
        if os.environ.get("ASTRAI_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_LLAMA_CPP=1 but {why}")
        pytest.skip(why)
    model, _, _ = load_model(imported)
    chat = load_chat(imported / "tokenizer.json")
    ours = generate(model, chat.encode_prompt(QUESTION), MAX_NEW, stop_ids=chat.stop_ids)
    assert ours[-1] == 2 and len(ours) < MAX_NEW
    gguf_file = export_gguf(imported, tmp_path / "m.gguf")
    from gguf import GGUFReader

    fields = GGUFReader(gguf_file).fields
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2  # its own eos, not astrai's (which it lacks)
    assert fields["tokenizer.chat_template"].contents() == CHATML
    assert llama_greedy(bin_dir, gguf_file, CHATML_PROMPT(), MAX_NEW) == token_bytes(imported / "tokenizer.json",
                                                                                      ours[:-1])
