"""The chat records' schema: the three kinds (sft, dpo, grpo), the prompts the demo and the evaluation share, and
the validation every record passes (`check_record`; `read_records` for a user's JSONL file).

    sft:  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}   (or {"prompt", "response"})
    dpo:  {"prompt": str, "chosen": str, "rejected": str}
    grpo: {"prompt": str, "answer": str, "options": [str, ...]}     (options [] when a user file gives none)
"""

from __future__ import annotations

import json
from pathlib import Path

from astrai_core.runtime.errors import AstraiError
from astrai_core.tokenizer.bpe import SPECIAL_TOKENS
from astrai_core.tokenizer.chat import ROLES

KINDS = ("sft", "dpo", "grpo")


# --- validation -----------------------------------------------------------------------------------------------------

# Each turn costs its two special tokens (role header, end of turn), ~3 characters each at the context's budget.
TURN_CHARS = 6


def rendered_chars(record: dict, kind: str) -> int:
    """Characters of a normalised record as the model sees it (DPO: the longer of the two replies)."""
    if kind == "sft":
        return sum(len(m["content"]) + TURN_CHARS for m in record["messages"])
    if kind == "dpo":
        return len(record["prompt"]) + max(len(record["chosen"]), len(record["rejected"])) + 2 * TURN_CHARS
    return len(record["prompt"]) + len(record["answer"]) + 2 * TURN_CHARS


def check_record(record: object, kind: str, max_chars: int) -> tuple[dict | None, str | None]:
    """(the normalised record, None) or (None, the reason it is refused)."""
    if not isinstance(record, dict):
        return None, f"not a JSON object (got {type(record).__name__})"
    if kind == "sft":
        out, problem = _check_sft(record)
    elif kind == "dpo":
        out, problem = _check_fields(record, ("prompt", "chosen", "rejected"))
        if out is not None and out["chosen"] == out["rejected"]:
            out, problem = None, "chosen is identical to rejected"
    else:
        out, problem = _check_grpo(record)
    if out is None:
        return None, problem
    n = rendered_chars(out, kind)
    if n > max_chars:
        return None, f"longer than the context: {n} characters > max_chars {max_chars}"
    return out, None


def _special_token(text: str) -> str | None:
    return next((tok for tok in SPECIAL_TOKENS.values() if tok in text), None)


def _check_fields(record: dict, names: tuple[str, ...]) -> tuple[dict | None, str | None]:
    out = {}
    for name in names:
        if name not in record:
            return None, f"missing field '{name}'"
        value = record[name]
        if not isinstance(value, str):
            return None, f"field '{name}' must be a string, got {type(value).__name__}"
        if not value.strip():
            return None, f"empty field '{name}'"
        if tok := _special_token(value):
            return None, f"field '{name}' contains the special token {tok}"
        out[name] = value
    return out, None


def _check_sft(record: dict) -> tuple[dict | None, str | None]:
    if "messages" not in record:
        if "prompt" in record or "response" in record:
            pair, problem = _check_fields(record, ("prompt", "response"))
            if pair is None:
                return None, problem
            return {"messages": [{"role": "user", "content": pair["prompt"]},
                                 {"role": "assistant", "content": pair["response"]}]}, None
        return None, "neither 'messages' nor 'prompt' and 'response'"
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return None, "'messages' must be a non-empty list"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, f"message {i}: not an object"
        if m.get("role") not in ROLES:
            return None, f"message {i}: unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})"
        content = m.get("content")
        if not isinstance(content, str):
            return None, f"message {i}: content must be a string, got {type(content).__name__}"
        if not content.strip():
            return None, f"message {i}: empty content"
        if tok := _special_token(content):
            return None, f"message {i}: content contains the special token {tok}"
        out.append({"role": m["role"], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        return None, "no assistant turn"
    return {"messages": out}, None


def _check_grpo(record: dict) -> tuple[dict | None, str | None]:
    out, problem = _check_fields(record, ("prompt", "answer"))
    if out is None:
        return None, problem
    out["answer"] = out["answer"].strip()  # rewards compare the stripped completion with it
    options = record.get("options")
    if options is None or options == []:  # no options: an open question
        out["options"] = []
        return out, None
    if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options):
        return None, "'options' must be a list of non-empty strings"
    out["options"] = [o.strip() for o in options]
    if out["answer"] not in out["options"]:
        return None, f"answer {out['answer']!r} is not among the options"
    return out, None


def read_records(path: Path, kind: str, on_bad: str, max_chars: int = 600) -> tuple[list[dict], list[str]]:
    """Normalised records of a JSONL file and its problems ("PATH:LINE: reason"); on_bad="stop" raises the first.

    Blank lines are not records. A file with no valid record at all is an error whatever on_bad says."""
    path = Path(path)
    records, problems = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            problem = None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problem = f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
            else:
                if not line.strip():
                    continue
                try:
                    record, problem = check_record(json.loads(line), kind, max_chars)
                except json.JSONDecodeError as e:
                    problem = f"invalid JSON ({e.msg} at column {e.colno})"
            if problem is not None:
                if on_bad == "stop":
                    raise AstraiError(f"{path}:{lineno}: {problem}")
                problems.append(f"{path}:{lineno}: {problem}")
            else:
                records.append(record)
    if not records:
        first = f"; first: {problems[0]}" if problems else ""
        raise AstraiError(f"{path}: no valid {kind} records ({len(problems)} bad{first})")
    return records, problems


