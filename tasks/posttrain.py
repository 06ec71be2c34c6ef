"""The post-training data stages chat_data and dpo_reference, each `astrai stage NAME` (the training stages sft, dpo
and grpo are in tasks/training.py).

chat_data   derives (or reads and validates) the SFT / DPO / GRPO records (tasks/chat_data.py) and tokenizes them
            with the chat template: sft_{train,test}.h5 (conversations + loss mask), dpo_{train,test}.h5 (pair i =
            documents 2i chosen, 2i + 1 rejected, mask on the response), grpo_{train,test}.jsonl (prompts that fit).
            sft_train.h5 ends with pretraining text (replay): windows of the packed train split, whole rows with
            every token a target, `chat_data.sft_replay` of the SFT loss tokens, so fine-tuning does not forget
            language modeling.
dpo_reference
            the DPO pairs as the model DPO starts from sees them, and that model's (the frozen reference's)
            log-probabilities of the training pairs, computed once and keyed by the data's and the reference
            weights' sha256 (the dpo stage refuses a stale cache), so training never holds a reference model.
            With `dpo.rejected: on_policy` each pair's rejected reply becomes the reference's own wrong answer
            to the prompt (on_policy_pairs): records/ and dpo_{train,test}.h5 here, what dpo trains on and
            evaluate scores preference accuracy on. With `static` the chat_data pairs are used as they are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from astrai_core.chat import ChatFormat, load_chat
from astrai_core.checkpoint import load_model
from astrai_core.data import PackedTokens, PackedWriter
from astrai_core.dpo_reference import reference_logps, save_reference_logps
from astrai_core.errors import AstraiError
from astrai_core.scoring import answer_questions
from astrai_core.io import atomic_path, sha256_file, write_json
from astrai_core.rewards import exact_answer
from tasks.chat_data import build_chat_data
from tasks.layout import CHAT, DPO_REFERENCE
from tasks.params import Params, dpo_pairs, start_model
from tasks.training import write_skipped

SPLITS = ("train", "test")


def _problem(on_bad: str, problems: list[str], message: str) -> None:
    if on_bad == "stop":
        raise AstraiError(message)
    problems.append(message)


def pack_chat(params: Params, records_dir: Path, tokenizer_path: Path, out_dir: Path, replay_from: Path | None = None
              ) -> dict:
    """Tokenize the records into out_dir (a directory the caller makes atomic); returns counts and problems.
    A record that does not fit the context (seq_len + 1 tokens; a GRPO prompt plus max_new_tokens) is skipped
    and counted, or stops the stage, as chat_data.on_bad_record says. `replay_from`: the pretraining tokens
    (packed/train.h5) that sft_train.h5's replay rows come from."""
    chat = load_chat(tokenizer_path)
    on_bad, limit = params.chat_data.on_bad_record, params.pretrain.seq_len + 1
    attrs = _packed_attrs(chat, tokenizer_path, records_dir)
    stats: dict = {"problems": []}
    for split in SPLITS:
        for kind, fn in (("sft", _pack_sft), ("dpo", _pack_dpo)):
            path = records_dir / f"{kind}_{split}.jsonl"
            with PackedWriter(out_dir / f"{kind}_{split}.h5", split=f"{kind}_{split}", **attrs) as writer:
                n, targets = fn(chat, path, writer, limit, on_bad, stats["problems"])
                if kind == "sft" and split == "train" and params.chat_data.sft_replay > 0:
                    stats["sft_replay_rows"] = _add_replay(writer, replay_from, attrs["tokenizer_sha256"], targets,
                                                           params.chat_data.sft_replay, params.pretrain.seq_len,
                                                           params.chat_data.seed)
            stats[f"{kind}_{split}"] = n
        kept = []
        path = records_dir / f"grpo_{split}.jsonl"
        for lineno, record in _records(path):
            n = len(chat.encode_prompt([{"role": "user", "content": record["prompt"]}]))
            if n + params.grpo.objective.max_new_tokens > params.model.max_seq_len:
                _problem(on_bad, stats["problems"], f"{path}:{lineno}: prompt of {n} tokens + grpo.max_new_tokens "
                         f"{params.grpo.objective.max_new_tokens} is longer than the context ({params.model.max_seq_len})")
                continue
            kept.append(json.dumps(record, ensure_ascii=False) + "\n")
        (out_dir / f"grpo_{split}.jsonl").write_text("".join(kept), encoding="utf-8")
        stats[f"grpo_{split}"] = len(kept)
    for key in ("sft_train", "dpo_train", "grpo_train"):
        if not stats[key]:
            raise AstraiError(f"{records_dir / (key + '.jsonl')}: no record fits the context; nothing to train on")
    write_json(out_dir / "pack_stats.json", stats)
    return stats


def _packed_attrs(chat: ChatFormat, tokenizer_path: Path, records_dir: Path) -> dict:
    return dict(vocab_size=chat.tokenizer.get_vocab_size(), tokenizer_sha256=sha256_file(tokenizer_path),
                source_manifest_sha256=sha256_file(records_dir / "stats.json"), with_loss_mask=True)


def _add_replay(writer: PackedWriter, tokens_path: Path | None, tokenizer_sha256: str, chat_targets: int,
                share: float, seq_len: int, seed: int) -> int:
    """Append whole rows of pretraining text (every token a target) so that they are `share` of the file's loss
    tokens (chat_targets are the rest); windows at seeded random starts of tokens_path. Returns the row count."""
    if tokens_path is None:
        raise AstraiError("chat_data.sft_replay > 0 needs the packed pretraining tokens (run the pack stage)")
    with PackedTokens(tokens_path, expected_tokenizer_sha256=tokenizer_sha256) as data:
        tokens = data.tokens
        n_rows = math.ceil(chat_targets * share / (1 - share) / seq_len)
        n_windows = (len(tokens) - 1) // seq_len
        for w in np.random.default_rng(seed).choice(n_windows, size=min(n_rows, n_windows), replace=False):
            window = tokens[w * seq_len : (w + 1) * seq_len + 1]
            mask = np.ones(len(window), dtype=np.uint8)
            mask[0] = 0  # the first token has nothing before it in its row: seq_len targets
            writer.add_document(window, mask)
    return min(n_rows, n_windows)


def _records(path: Path):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, json.loads(line)


def _pack_sft(chat: ChatFormat, path: Path, writer: PackedWriter, limit: int, on_bad: str, problems: list
              ) -> tuple[int, int]:
    """(records packed, loss tokens)."""
    n = targets = 0
    for lineno, record in _records(path):
        try:
            ids, mask = chat.encode(record["messages"])
        except AstraiError as e:
            _problem(on_bad, problems, f"{path}:{lineno}: {e}")
            continue
        if len(ids) > limit:
            _problem(on_bad, problems, f"{path}:{lineno}: conversation of {len(ids)} tokens is longer than the context "
                     f"({limit})")
            continue
        writer.add_document(ids, mask)
        n, targets = n + 1, targets + sum(mask)
    return n, targets


def _pack_dpo(chat: ChatFormat, path: Path, writer: PackedWriter, limit: int, on_bad: str, problems: list
              ) -> tuple[int, int]:
    """(pairs packed, loss tokens)."""
    n = targets = 0
    for lineno, record in _records(path):
        prompt = [{"role": "user", "content": record["prompt"]}]
        try:
            pair = [chat.encode(prompt + [{"role": "assistant", "content": record[k]}]) for k in ("chosen", "rejected")]
        except AstraiError as e:
            _problem(on_bad, problems, f"{path}:{lineno}: {e}")
            continue
        longest = max(len(ids) for ids, _ in pair)
        if longest > limit:
            _problem(on_bad, problems, f"{path}:{lineno}: prompt + response of {longest} tokens is longer than the "
                     f"context ({limit})")
            continue
        for ids, mask in pair:
            writer.add_document(ids, mask)
        n, targets = n + 1, targets + sum(mask)
    return n, targets


def build_chat(params: Params, corpus_dir: Path, tokenizer_path: Path, out_dir: Path, replay_from: Path | None = None
               ) -> dict:
    """The chat_data stage: records/ (JSONL + stats.json) and the tokenized files, all or nothing."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        records = build_chat_data(params.chat_data, corpus_dir, tmp / "records")
        stats = pack_chat(params, tmp / "records", tokenizer_path, tmp, replay_from)
    return {"records": records, "packed": stats}


def on_policy_pairs(model, chat: ChatFormat, records: list[dict], max_new_tokens: int, seed: int,
                    samples: int = 8) -> tuple[list[dict], dict]:
    """The pairs with each rejected reply replaced by the model's own wrong answer to the prompt: its greedy reply
    when that is wrong, else the first wrong one of `samples` sampled at temperature 1; a prompt it always answers
    right, or too long to answer within its context, keeps its rejected reply. DPO then lowers what this model
    actually says, not text it would never produce. For pairs whose chosen reply is the one right answer (the
    demo's): a reply is wrong when it differs from it (rewards.exact_answer). Returns the new records and how
    many rejected replies came from where."""
    questions = {i: {"prompt": r["prompt"], "answer": r["chosen"]} for i, r in enumerate(records)
                 if len(chat.encode_prompt([{"role": "user", "content": r["prompt"]}])) + max_new_tokens
                 <= model.cfg.max_seq_len}
    wrong = lambda reply, q: bool(reply.strip()) and not exact_answer(reply, q)
    greedy = dict(zip(questions, (r[0] for r in answer_questions(model, chat, list(questions.values()),
                                                                 max_new_tokens))))
    rest = [i for i, g in greedy.items() if not wrong(g, questions[i])]
    sampled = dict(zip(rest, answer_questions(model, chat, [questions[i] for i in rest], max_new_tokens,
                                              samples=samples, temperature=1.0, seed=seed)))
    out, counts = [], {"greedy": 0, "sampled": 0, "kept": 0}
    for i, record in enumerate(records):
        if i in sampled:
            replies = [s for s in sampled[i] if wrong(s, questions[i])][:1]
            counts["sampled" if replies else "kept"] += 1
        elif i in greedy:
            replies = [greedy[i]]
            counts["greedy"] += 1
        else:
            replies = []
            counts["kept"] += 1
        out.append(record | {"rejected": replies[0].strip()} if replies else record)
    return out, counts


def dpo_reference(params: Params, root: Path, on_line: Callable[[str], None] = print) -> dict | None:
    """The dpo_reference stage: the pairs DPO trains and is evaluated on (on-policy: rewritten by the reference),
    and the reference's log-probabilities of the training pairs."""
    out_dir = root / DPO_REFERENCE
    if not params.dpo.enabled:
        write_skipped(out_dir, "dpo.enabled is false")
        return None
    ref = start_model(params, root, "dpo")  # what the dpo stage starts from
    model, _, _ = load_model(ref)
    info: dict = {"reference": str(ref.relative_to(root)), "rejected": params.dpo.rejected, "dtype": params.dpo.dtype}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        if params.dpo.rejected == "on_policy":
            info["on_policy"] = _write_on_policy_pairs(params, root, model, ref, tmp, on_line)
        data = dpo_pairs(params, root, "train")
        staged = tmp / data.relative_to(out_dir) if data.is_relative_to(out_dir) else data
        on_line(f"dpo_reference: scoring the DPO pairs of {data.relative_to(root)} with {ref.relative_to(root)}")
        logps = reference_logps(model, str(staged), sha256_file(ref / "tokenizer.json"), dtype=params.dpo.dtype)
        save_reference_logps(tmp / "train_logps.h5", logps, staged, ref / "model.safetensors")
        info |= {"documents": len(logps), "mean_logp": float(logps.mean())}
        write_json(tmp / "info.json", info)
    on_line(f"dpo_reference: {len(logps)} responses scored by {ref}")
    return info


def _write_on_policy_pairs(params: Params, root: Path, model, ref: Path, out_dir: Path,
                           on_line: Callable[[str], None]) -> dict:
    """records/dpo_{train,test}.jsonl and dpo_{train,test}.h5 in out_dir: chat_data's pairs, on-policy."""
    tokenizer_path = ref / "tokenizer.json"
    chat = load_chat(tokenizer_path)
    (out_dir / "records").mkdir()
    counts, problems = {}, []
    for split in SPLITS:
        source = root / CHAT / "records" / f"dpo_{split}.jsonl"
        if not source.is_file():
            raise AstraiError(f"{source}: not found; run the chat_data stage")
        records = [r for _, r in _records(source)]
        on_line(f"dpo_reference: {ref.relative_to(root)} answers the {len(records)} {split} DPO prompts")
        records, counts[split] = on_policy_pairs(model, chat, records, params.grpo.objective.max_new_tokens,
                                                   params.chat_data.seed)
        path = out_dir / "records" / f"dpo_{split}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    write_json(out_dir / "records" / "stats.json", counts)
    attrs = _packed_attrs(chat, tokenizer_path, out_dir / "records")
    for split in SPLITS:
        with PackedWriter(out_dir / f"dpo_{split}.h5", split=f"dpo_{split}", **attrs) as writer:
            _pack_dpo(chat, out_dir / "records" / f"dpo_{split}.jsonl", writer, params.pretrain.seq_len + 1,
                      params.chat_data.on_bad_record, problems)
    counts["skipped"] = len(problems)  # too long for the context: chat_data skipped (and counted) them too
    on_line(f"dpo_reference: rejected replies from the reference's greedy / sampled answers / kept: {counts}")
    return counts
