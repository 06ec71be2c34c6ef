"""Stage `dpo_reference`: the DPO pairs as the model DPO starts from sees them, and that model's (the frozen
reference's) log-probabilities of the training pairs, computed once and keyed by the data's and the reference
weights' sha256 (the dpo stage refuses a stale cache), so training never holds a reference model.

With `dpo.rejected: on_policy` each pair's rejected reply becomes the reference's own wrong answer to the prompt
(on_policy_pairs): records/ and dpo_{train,test}.h5 here, what dpo trains on and evaluate scores preference
accuracy on. With `static` the chat_data pairs are used as they are. Run alone: `astrai stage dpo_reference`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from astrai_core.checkpoint.model_dir import load_model
from astrai_core.data.packed import PackedWriter
from astrai_core.runtime.device import resolve_device
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from astrai_core.scoring.dpo_reference import reference_logps, save_reference_logps
from astrai_core.scoring.metrics import answer_questions
from astrai_core.tokenizer.chat import ChatFormat, load_chat
from astrai_core.training.rewards import exact_answer
from tasks.run.configs import dpo_pairs, start_model
from tasks.run.schema import Params
from tasks.run.table import CHAT, DPO_REFERENCE
from tasks.stages.chat_data import SPLITS, numbered_records, pack_dpo, packed_attrs
from tasks.stages.training import write_skipped


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
        write_skipped(out_dir, "dpo.enabled is false", "stage dpo_reference")
        return None
    ref = start_model(params, root, "dpo")  # what the dpo stage starts from
    device = resolve_device(params.dpo.device)  # where the dpo stage will train
    model, _, _ = load_model(ref, device=device)
    on_line(f"dpo_reference: {ref.relative_to(root)} on {device}")
    info: dict = {"reference": str(ref.relative_to(root)), "rejected": params.dpo.rejected, "dtype": params.dpo.dtype}
    with atomic_path(out_dir, "stage dpo_reference") as tmp:
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
        records = [r for _, r in numbered_records(source)]
        on_line(f"dpo_reference: {ref.relative_to(root)} answers the {len(records)} {split} DPO prompts")
        records, counts[split] = on_policy_pairs(model, chat, records, params.grpo.objective.max_new_tokens,
                                                   params.chat_data.seed)
        path = out_dir / "records" / f"dpo_{split}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    write_json(out_dir / "records" / "stats.json", counts)
    attrs = packed_attrs(chat, tokenizer_path, out_dir / "records")
    for split in SPLITS:
        with PackedWriter(out_dir / f"dpo_{split}.h5", split=f"dpo_{split}", **attrs) as writer:
            pack_dpo(chat, out_dir / "records" / f"dpo_{split}.jsonl", writer, params.pretrain.seq_len + 1,
                      params.chat_data.on_bad_record, problems)
    counts["skipped"] = len(problems)  # too long for the context: chat_data skipped (and counted) them too
    on_line(f"dpo_reference: rejected replies from the reference's greedy / sampled answers / kept: {counts}")
    return counts
