"""Stage `chat_data`: data/corpus -> data/chat/records/{sft,dpo,grpo}_{train,test}.jsonl + stats.json, and those
records tokenized with the chat template (chat_data, the stage: write_records, then pack_chat):

* sft_{train,test}.h5: conversations + loss mask; sft_train.h5 ends with pretraining text (replay): windows of the
  packed train split, whole rows with every token a target, `chat_data.sft_replay` of the SFT loss tokens, so
  fine-tuning does not forget language modeling.
* dpo_{train,test}.h5: pair i = documents 2i chosen, 2i + 1 rejected, mask on the response.
* grpo_{train,test}.jsonl: the prompts that fit the context.

Each kind (`chat_data.sft`, `.dpo`, `.grpo` in params.yaml) is either "demo", derived from the plays without any
download, or the path of the user's own JSONL file, read and validated here.

Demo records are the tasks of tasks/chat/demo_tasks.py (questions about a short passage whose answer follows from the
prompt: who speaks first, how many speeches, how many words a line has, whether it asks a question, its last
word), the tasks taking turns. Train records come from the corpus's `train` plays, test records from its `test`
plays (the `validation` plays are left alone), and a test prompt that also occurs in training (a line two plays
share) is dropped, so the test files are truly held out. Within a split each prompt feeds one record of one kind: no DPO
pair or GRPO prompt repeats an SFT example.

* SFT: the question, answered. DPO: the question, chosen = the answer, rejected = a plausible wrong answer (the
  next speaker, a count off by one, the other answer to a yes/no question, the word before the last). GRPO: the
  question with its answer, checked exactly by the reward.

Record formats (the contract with the training code; every record is validated by `check_record`):

    sft:  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
    dpo:  {"prompt": str, "chosen": str, "rejected": str}
    grpo: {"prompt": str, "answer": str, "options": [str, ...]}     (options [] when a user file gives none)

Demo records also carry "task" (the task's name: the evaluation reports each task's accuracy). A user file may
hold SFT records as {"prompt", "response"}: they become a user and an assistant message. Its records are split by
`test_fraction` (chosen by seed). Everything is deterministic in the seed: two runs write the same bytes.

The plays' parsing is tasks/chat/plays.py, the tasks tasks/chat/demo_tasks.py, the records' schema and validation
tasks/chat/records.py; this module derives the demo records and writes the files. Run alone: `astrai stage
chat_data`, or from Python:
    chat_data(Params(), Path("data/corpus"), Path("data/tokenizer/tokenizer.json"), Path("data/chat"),
              replay_from=Path("data/packed/train.h5"))                                    # the stage
    write_records(ChatDataParams(), Path("data/corpus"), Path("data/chat/records"))         # the records alone
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from itertools import zip_longest
from pathlib import Path

import numpy as np

from astrai_core.data.packed import PackedTokens, PackedWriter
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from astrai_core.runtime.progress import advance, expect
from astrai_core.tokenizer.chat import ChatFormat, load_chat
from tasks.chat.demo_tasks import Item, items
from tasks.chat.plays import Speech, read_plays
from tasks.chat.records import KINDS, check_record, read_records
from tasks.run.schema import DEMO, ChatDataParams, Params


SIZE_KEYS = {"sft": "sft_examples", "dpo": "dpo_pairs", "grpo": "grpo_prompts"}  # each train file's size key


def demo_sizes(params: ChatDataParams) -> dict[str, dict[str, int]]:
    """{split: {kind: records asked for}}: the train files' sizes by SIZE_KEYS, every test file test_examples."""
    return {"train": {k: getattr(params, key) for k, key in SIZE_KEYS.items()},
            "test": {k: params.test_examples for k in KINDS}}


def derive_demo(plays: dict[str, dict[str, list[Speech]]], params: ChatDataParams, kinds: tuple[str, ...]
                ) -> tuple[dict[str, dict[str, list[dict]]], Counter]:
    """{split: {kind: records}} of the demo kinds from the train and test plays, and why items were skipped.
    Each split's items (the tasks taking turns) are dealt out in order, each item once: DPO pairs, then GRPO prompts,
    then SFT, each kind taking the next items of its tasks (chat_data.dpo_tasks, .grpo_tasks; SFT every task)."""
    sizes = demo_sizes(params)
    tasks = {"dpo": set(params.dpo_tasks), "grpo": set(params.grpo_tasks), "sft": set()}  # empty: every task
    out: dict[str, dict[str, list[dict]]] = {}
    skipped: Counter = Counter()
    train_prompts: set[str] = set()
    for split in ("train", "test"):
        pool = items(plays[split], f"{params.seed}:chat_data:{split}", exclude=train_prompts)
        if split == "train":
            train_prompts = {item.prompt for item in pool}
        out[split], dealt = {}, [False] * len(pool)
        for kind in ("dpo", "grpo", "sft"):
            if kind not in kinds:
                continue
            records = out[split][kind] = []
            left = [i for i, item in enumerate(pool) if not dealt[i] and (not tasks[kind] or item.task in tasks[kind])]
            for i in in_turns(pool, left):
                if len(records) == sizes[split][kind]:
                    break
                record, dealt[i] = pool[i].record(kind), True
                problem = check_record(record, kind, params.max_chars)[1]
                if problem is None:
                    records.append(record)
                else:
                    skipped[f"{kind}: {problem.split(':')[0]}"] += 1  # "longer than the context: N characters ..."
    return out, skipped


def in_turns(pool: list[Item], left: list[int]) -> list[int]:
    """The indices `left` of pool's items in an order where their tasks take turns, each task's items in pool order:
    a kind dealt after another took some tasks' items still gets every task evenly. Of a pool already in turns
    (items()) from which a prefix was dealt, the rest in its own order."""
    by_task: dict[str, list[int]] = {}
    for i in left:
        by_task.setdefault(pool[i].task, []).append(i)
    return [i for turn in zip_longest(*by_task.values()) for i in turn if i is not None]


# --- the stage ------------------------------------------------------------------------------------------------------


def split_records(records: list[dict], test_fraction: float, seed: int, kind: str) -> tuple[list[dict], list[dict]]:
    """(train, test) of a user file: test_fraction of the records (at least one when there are two or more and the
    fraction is not 0, never all of them), chosen by seed; both keep the file's order."""
    n = len(records)
    k = round(n * test_fraction)
    if test_fraction > 0 and n >= 2:
        k = max(k, 1)
    k = min(k, n - 1)
    test = set(random.Random(f"{seed}:chat_data:{kind}:split").sample(range(n), k))
    return [r for i, r in enumerate(records) if i not in test], [r for i, r in enumerate(records) if i in test]


def write_records(params: ChatDataParams, corpus_dir: Path, out_dir: Path, enabled: tuple[str, ...] = KINDS) -> dict:
    """Write out_dir/{sft,dpo,grpo}_{train,test}.jsonl and stats.json (all or nothing); return the stats.

    A kind whose stage is not in `enabled` needs no data: its user file is not read, and its demo records are
    derived only when the corpus has plays (evaluation then still scores every model on them); else it is empty."""
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    data: dict[str, dict[str, list[dict]]] = {"train": {kind: [] for kind in KINDS}, "test": {kind: [] for kind in KINDS}}
    stats: dict = {"seed": params.seed, "max_chars": params.max_chars, "sources": {}, "skipped": {}}

    for kind in KINDS:  # user files first: a missing one fails before the plays are parsed
        source = getattr(params, kind)
        if kind not in enabled:
            stats["sources"][kind] = f"none: {kind}.enabled is false"
        if source == DEMO or kind not in enabled:
            continue
        path = Path(source).expanduser()
        if not path.is_file():
            raise AstraiError(f"chat_data.{kind}: {source}: file not found (expected 'demo' or a JSONL file)")
        records, problems = read_records(path, kind, params.on_bad_record, params.max_chars)
        data["train"][kind], data["test"][kind] = split_records(records, params.test_fraction, params.seed, kind)
        stats["sources"][kind] = str(path)
        stats["skipped"][kind] = {"count": len(problems), "problems": problems[:100]}

    demo = tuple(k for k in KINDS if getattr(params, k) == DEMO)
    plays = {split: read_plays(corpus_dir / f"{split}.jsonl") for split in ("train", "test")} if demo else {}
    if not all(any(speeches.values()) for speeches in plays.values()):
        demo = tuple(k for k in demo if k in enabled)  # no plays: only an enabled stage's demo data is an error
    if demo:
        for split, speeches in plays.items():
            if not any(speeches.values()):
                raise AstraiError(f"{corpus_dir / f'{split}.jsonl'}: no play with speeches in the corpus's {split} "
                                  f"split to derive the demo {'/'.join(demo)} data from; set chat_data.{demo[0]} "
                                  "to a JSONL file")
        records, skipped = derive_demo(plays, params, demo)
        sizes = demo_sizes(params)
        stats["plays"] = {split: {doc_id: len(s) for doc_id, s in p.items()} for split, p in plays.items()}
        for kind in demo:
            for split in ("train", "test"):
                if not records[split][kind]:
                    raise AstraiError(f"{corpus_dir}: no demo {kind} records could be derived from the {split} "
                                      "plays (too few speeches)")
                data[split][kind] = records[split][kind]
                asked = sizes[split][kind]
                if len(records[split][kind]) < asked:  # fewer items than asked: said, not silently trained on
                    key = SIZE_KEYS[kind] if split == "train" else "test_examples"
                    print(f"WARNING: chat_data: {key}: {asked} asked, only {len(records[split][kind])} demo {kind} "
                          f"records could be derived from the {split} plays", flush=True)
            stats["sources"][kind] = (f"demo: tasks/chat/demo_tasks.py on the train/test plays of {corpus_dir} "
                                      f"({len(plays['train'])}/{len(plays['test'])} documents)")
            stats["skipped"][kind] = {"count": sum(n for r, n in skipped.items() if r.startswith(kind)),
                                      "reasons": {r: n for r, n in sorted(skipped.items()) if r.startswith(kind)}}
        stats["tasks"] = {f"{kind}_{split}": dict(Counter(r["task"] for r in records[split][kind]))
                          for split in records for kind in records[split]}

    stats["files"] = {}
    with atomic_path(out_dir, "stage chat_data") as tmp:
        tmp.mkdir()
        for kind in KINDS:
            for split in ("train", "test"):
                name = f"{kind}_{split}.jsonl"
                with open(tmp / name, "w", encoding="utf-8") as f:
                    for record in data[split][kind]:
                        f.write(json.dumps(record, ensure_ascii=False) + "\n")
                stats["files"][name] = len(data[split][kind])
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


# The stage's second half: the records tokenized with the chat template (chat_data is the stage).

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
    attrs = packed_attrs(chat, tokenizer_path, records_dir)
    stats: dict = {"problems": []}
    expect(len(SPLITS) * len(KINDS), "record files tokenized")
    for split in SPLITS:
        for kind, fn in (("sft", _pack_sft), ("dpo", pack_dpo)):
            path = records_dir / f"{kind}_{split}.jsonl"
            with PackedWriter(out_dir / f"{kind}_{split}.h5", split=f"{kind}_{split}", **attrs) as writer:
                n, targets = fn(chat, path, writer, limit, on_bad, stats["problems"])
                if kind == "sft" and split == "train" and params.chat_data.sft_replay > 0:
                    stats["sft_replay_rows"] = _add_replay(writer, replay_from, attrs["tokenizer_sha256"], targets,
                                                           params.chat_data.sft_replay, params.pretrain.seq_len,
                                                           params.chat_data.seed)
            stats[f"{kind}_{split}"] = n
            advance()
        kept = []
        path = records_dir / f"grpo_{split}.jsonl"
        # the model's context; a model pretrain.init_from gives has its own: the window the stages train in then
        context = params.pretrain.seq_len if params.pretrain.init_from else params.model.max_seq_len
        for lineno, record in numbered_records(path):
            n = len(chat.encode_prompt([{"role": "user", "content": record["prompt"]}]))
            if n + params.grpo.objective.max_new_tokens > context:
                _problem(on_bad, stats["problems"], f"{path}:{lineno}: prompt of {n} tokens + grpo.max_new_tokens "
                         f"{params.grpo.objective.max_new_tokens} is longer than the context ({context})")
                continue
            kept.append(json.dumps(record, ensure_ascii=False) + "\n")
        (out_dir / f"grpo_{split}.jsonl").write_text("".join(kept), encoding="utf-8")
        stats[f"grpo_{split}"] = len(kept)
        advance()
    for key in (f"{kind}_train" for kind in KINDS if getattr(params, kind).enabled):  # a disabled stage needs none
        if not stats[key]:
            raise AstraiError(f"{records_dir / (key + '.jsonl')}: no record fits the context; nothing to train on")
    write_json(out_dir / "pack_stats.json", stats)
    return stats


def packed_attrs(chat: ChatFormat, tokenizer_path: Path, records_dir: Path) -> dict:
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


def numbered_records(path: Path):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, json.loads(line)


def _pack_sft(chat: ChatFormat, path: Path, writer: PackedWriter, limit: int, on_bad: str, problems: list
              ) -> tuple[int, int]:
    """(records packed, loss tokens)."""
    n = targets = 0
    for lineno, record in numbered_records(path):
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


def pack_dpo(chat: ChatFormat, path: Path, writer: PackedWriter, limit: int, on_bad: str, problems: list
              ) -> tuple[int, int]:
    """(pairs packed, loss tokens)."""
    n = targets = 0
    for lineno, record in numbered_records(path):
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


def chat_data(params: Params, corpus_dir: Path, tokenizer_path: Path, out_dir: Path, replay_from: Path | None = None
              ) -> dict:
    """The chat_data stage: records/ (JSONL + stats.json) and the tokenized files, all or nothing."""
    with atomic_path(out_dir, "stage chat_data") as tmp:
        tmp.mkdir()
        records = write_records(params.chat_data, corpus_dir, tmp / "records",
                                tuple(kind for kind in KINDS if getattr(params, kind).enabled))
        stats = pack_chat(params, tmp / "records", tokenizer_path, tmp, replay_from)
    return {"records": records, "packed": stats}

