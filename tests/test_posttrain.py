"""Post-training through the training core: SFT, DPO, GRPO, LoRA and two-stage KL pretraining, in process on
tiny data (the pipeline test runs them under torchrun as stages)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai_core.checkpoint.model_dir import load_model, save_checkpoint
from astrai_core.data.batches import Batch, Documents, PackedRows
from astrai_core.data.packed import PackedWriter
from astrai_core.model.config import ModelConfig
from astrai_core.model.losses import IGNORE_INDEX, token_logps
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file
from astrai_core.scoring.dpo_reference import reference_logps, save_reference_logps
from astrai_core.scoring.metrics import answer_questions, masked_token_loss
from astrai_core.tokenizer.bpe import train_tokenizer
from astrai_core.tokenizer.chat import DEFAULT_TEMPLATE, load_chat
from astrai_core.training.config import TrainConfig
from astrai_core.training.rewards import REWARDS
from astrai_core.training.train import default_callbacks, train
from tasks.run.params import parse_params
from tasks.stages.chat_data import pack_chat
from tasks.stages.dpo_reference import on_policy_pairs

from test_resume import SigtermAt

NAMES = ["ROMEO", "JULIET", "HAMLET", "OPHELIA", "LEAR", "CORDELIA"]
WORDS = "love night sword crown grave ghost storm heart daughter father king queen poison letter moon".split()
MODEL = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))).capitalize() + "."


def _records(rng: random.Random, n: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"sft": [], "dpo": [], "grpo": []}
    for _ in range(n):
        name, line = rng.choice(NAMES), _line(rng)
        options = rng.sample([x for x in NAMES if x != name], 2) + [name]
        rng.shuffle(options)
        question = f'Who says: "{line}"?\n' + ", ".join(options)
        out["sft"].append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": name}]})
        out["dpo"].append({"prompt": f"Continue:\n{line}", "chosen": f"{name}.\n{_line(rng)}", "rejected": f"{name}.\n{_line(rng)} Ha ha ha."})
        out["grpo"].append({"prompt": question, "answer": name, "options": options})
    return out


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory) -> dict:
    """Tokenizer + chat template, packed SFT/DPO files, GRPO prompts, and a random base checkpoint."""
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    tok = train_tokenizer([_line(rng) + " " + " ".join(NAMES) for _ in range(300)] + ["Who says: Continue:"] * 20, 320)
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "chat_template.jinja").write_text(DEFAULT_TEMPLATE)
    records_dir = root / "records"
    records_dir.mkdir()
    for split, n in (("train", 96), ("test", 24)):
        for kind, rows in _records(rng, n).items():
            (records_dir / f"{kind}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (records_dir / "stats.json").write_text("{}")
    params = parse_params({"model": MODEL, "tokenizer": {"vocab_size": 320}, "pretrain": {"seq_len": 64},
                           "grpo": {"objective": {"max_new_tokens": 6}}, "chat_data": {"sft_replay": 0.0}})
    (root / "chat").mkdir()
    stats = pack_chat(params, records_dir, root / "tok" / "tokenizer.json", root / "chat")
    assert stats["sft_train"] == 96 and stats["grpo_train"] == 96, stats
    # Pairs longer than the context (65 tokens) are skipped and reported with their file and line.
    assert 70 < stats["dpo_train"] < 96 and len([p for p in stats["problems"] if "dpo_train" in p]) == 96 - stats["dpo_train"]
    assert all(":" in p and "longer than the context (65)" in p for p in stats["problems"])
    torch.manual_seed(0)
    save_checkpoint(root / "base", Transformer(ModelConfig(**MODEL)), ModelConfig(**MODEL), root / "tok" / "tokenizer.json")
    return {"root": root, "tokenizer": root / "tok" / "tokenizer.json", "chat": root / "chat", "base": root / "base"}


def make_cfg(setup: dict, out: Path, strategy: str, **kw) -> TrainConfig:
    data = {"sft": "sft_train.h5", "dpo": "dpo_train.h5", "grpo": "grpo_train.jsonl"}[strategy]
    base = dict(model=MODEL, strategy=strategy, train_data=str(setup["chat"] / data), tokenizer=str(setup["tokenizer"]),
                out_dir=str(out), init_from=str(setup["base"]), seq_len=64, batch_size=4, max_steps=20, log_every=1,
                device="cpu", optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.0))
    return TrainConfig.model_validate({**base, **kw})


def metrics(cfg: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _no_mlflow_run(monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)


# ---- SFT -----------------------------------------------------------------------------------------------------

def test_sft_replay_rows_are_pretraining_windows_at_the_asked_share(chat_setup, tmp_path):
    tok = sha256_file(chat_setup["tokenizer"])
    stream = np.arange(5000) % 320  # a recognisable "pretraining" token stream
    with PackedWriter(tmp_path / "train.h5", vocab_size=320, tokenizer_sha256=tok, source_manifest_sha256="x",
                      split="train") as w:
        w.add_document(stream)
    records_dir = chat_setup["root"] / "records"
    params = parse_params({"model": MODEL, "tokenizer": {"vocab_size": 320}, "pretrain": {"seq_len": 64},
                           "grpo": {"objective": {"max_new_tokens": 6}}, "chat_data": {"sft_replay": 0.5}})
    (tmp_path / "chat").mkdir()
    stats = pack_chat(params, records_dir, chat_setup["tokenizer"], tmp_path / "chat", replay_from=tmp_path / "train.h5")
    plain = Documents(str(chat_setup["chat"] / "sft_train.h5"), tok, 320)  # the same records without replay
    mixed = Documents(str(tmp_path / "chat" / "sft_train.h5"), tok, 320)
    n = stats["sft_replay_rows"]
    assert mixed.n_docs == plain.n_docs + n and n > 0
    chat_targets = int(plain.loss_mask.sum())
    replay_targets = int(mixed.loss_mask.sum()) - chat_targets
    assert replay_targets == n * 64  # whole rows (seq_len + 1 tokens), every token but the first a target
    assert chat_targets <= replay_targets < chat_targets + 64  # half of the loss tokens, to within one row
    for d in range(plain.n_docs, mixed.n_docs):
        window = mixed.tokens[mixed.doc_offsets[d]: mixed.doc_offsets[d + 1]]
        assert len(window) == 65 and window[0] % 64 == 0 and (np.diff(window) % 320 == 1).all()  # a window of it
    with pytest.raises(AstraiError, match="sft_replay > 0 needs the packed pretraining tokens"):
        pack_chat(params, records_dir, chat_setup["tokenizer"], tmp_path / "again")


def test_packed_rows_block_documents_and_learn_only_assistant_tokens(chat_setup):
    data = Documents(str(chat_setup["chat"] / "sft_train.h5"), sha256_file(chat_setup["tokenizer"]), 320)
    rows = PackedRows(data, seq_len=160)
    assert sum(len(r) for r in rows.rows) == data.n_docs and max(len(r) for r in rows.rows) > 1  # packed
    chat = load_chat(chat_setup["tokenizer"])
    x, y, pos, doc = rows.row(0)
    assert len(x) == 160
    for j, d in enumerate(rows.rows[0]):
        sel = doc == j
        ids = data.tokens[data.doc_offsets[d]: data.doc_offsets[d + 1]]
        assert pos[sel].tolist() == list(range(sel.sum()))  # positions restart per conversation
        learned = [t for t in y[sel] if t != IGNORE_INDEX]
        # Exactly the assistant reply and its end-of-turn are targets; never the next conversation's first token.
        mask = data.loss_mask[data.doc_offsets[d]: data.doc_offsets[d + 1]]
        assert learned == [int(t) for t, m in zip(ids, mask) if m]
        assert chat.tokenizer.decode(learned[:-1]) in NAMES and learned[-1] == chat.stop_ids[0]
    assert (y[doc == len(rows.rows[0])] == IGNORE_INDEX).all()  # padding


def test_sft_lowers_held_out_assistant_loss(chat_setup, tmp_path):
    tok_sha = sha256_file(chat_setup["tokenizer"])
    test = str(chat_setup["chat"] / "sft_test.h5")
    before = masked_token_loss(load_model(chat_setup["base"])[0], test, tok_sha, 64)
    cfg = make_cfg(chat_setup, tmp_path / "sft", "sft", val_data=test, max_steps=30, eval_every=10)
    summary = train(cfg)
    after = masked_token_loss(load_model(cfg.out_dir)[0], test, tok_sha, 64)
    assert after < before - 1.5, (before, after)  # nats per assistant token; ln(320) = 5.8 at init
    assert summary["final_val_loss"] == pytest.approx(after, rel=0.05)  # the loop's validation is the same measure


def test_sft_with_lora_trains_adapters_and_saves_the_merged_model(chat_setup, tmp_path):
    from astrai_core.model.lora import load_adapters, merge_lora

    cfg = make_cfg(chat_setup, tmp_path / "lora", "sft", max_steps=10, lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]})
    summary = train(cfg)
    assert summary["trainable_params"] < summary["n_params"] / 10
    out = Path(cfg.out_dir)
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    merged, _, _ = load_model(out)  # a plain model: loads like any checkpoint
    base, _, _ = load_model(chat_setup["base"])
    load_adapters(base, out)
    rebuilt = merge_lora(base)
    x = torch.randint(0, 320, (2, 16))
    torch.testing.assert_close(rebuilt(x), merged(x), atol=1e-5, rtol=1e-5)
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, load_model(chat_setup["base"])[0].state_dict()[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in changed)


def test_init_from_refuses_another_shape(chat_setup, tmp_path):
    cfg = make_cfg(chat_setup, tmp_path / "x", "sft", model={**MODEL, "dim": 64})
    with pytest.raises(AstraiError, match="model differs.*dim"):
        train(cfg)


# ---- DPO -----------------------------------------------------------------------------------------------------

def _reference(chat_setup, out: Path) -> str:
    data = chat_setup["chat"] / "dpo_train.h5"
    logps = reference_logps(load_model(chat_setup["base"])[0], str(data), sha256_file(chat_setup["tokenizer"]))
    save_reference_logps(out, logps, data, chat_setup["base"] / "model.safetensors")
    return str(out)


def test_dpo_learns_the_preference_and_starts_at_zero_reward(chat_setup, tmp_path):
    ref = _reference(chat_setup, tmp_path / "ref.h5")
    cfg = make_cfg(chat_setup, tmp_path / "dpo", "dpo", dpo={"beta": 0.5, "reference_logps": ref}, max_steps=15)
    train(cfg)
    m = metrics(cfg)
    # Step 1: the policy is the reference, so the cached log-probabilities give zero rewards.
    assert m[0]["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert m[0]["train/loss"] == pytest.approx(np.log(2), abs=1e-4)  # -log sigmoid(0)
    assert m[-1]["dpo/reward_accuracy"] >= 0.9 and m[-1]["dpo/reward_margin"] > 0.5
    assert {"dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/logps_chosen"} <= set(m[-1])


def test_on_policy_pairs_reject_the_models_own_wrong_answers(chat_setup):
    model, _, _ = load_model(chat_setup["base"])
    with torch.no_grad():  # sharper: the untrained model's greedy reply is empty (the end of turn), this one's is not
        for p in model.parameters():
            p.mul_(8)
    chat = load_chat(chat_setup["tokenizer"])
    grpo = [json.loads(line) for line in (chat_setup["root"] / "records" / "grpo_test.jsonl").read_text().splitlines()]
    records = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": "static"} for r in grpo[:12]]
    greedy = [r[0].strip() for r in answer_questions(model, chat, records, 6)]
    for r, g in list(zip(records, greedy))[::2]:  # these the model answers right (greedy)
        r["chosen"] = g
    out, counts = on_policy_pairs(model, chat, records, 6, seed=0)
    wrong_greedy = [i for i, (r, g) in enumerate(zip(records, greedy)) if g and g != r["chosen"]]
    assert len(wrong_greedy) >= 3 and counts["greedy"] == len(wrong_greedy) and sum(counts.values()) == 12
    for i, (before, after) in enumerate(zip(records, out)):
        assert (after["prompt"], after["chosen"]) == (before["prompt"], before["chosen"])
        assert after["rejected"].strip() != after["chosen"].strip()  # never the right answer
        if i in wrong_greedy:
            assert after["rejected"] == greedy[i]  # the model's own greedy answer
        else:  # right when greedy: a wrong sampled answer, or the static one when every sample was right
            assert after["rejected"] != greedy[i] or not greedy[i]
    assert counts["sampled"] + counts["kept"] == 12 - len(wrong_greedy)
    assert on_policy_pairs(model, chat, records, 6, seed=0) == (out, counts)  # seeded


def test_dpo_refuses_a_stale_reference_cache(chat_setup, tmp_path):
    ref = _reference(chat_setup, tmp_path / "ref.h5")
    other = tmp_path / "other"
    torch.manual_seed(1)
    save_checkpoint(other, Transformer(ModelConfig(**MODEL)), ModelConfig(**MODEL), chat_setup["tokenizer"])
    cfg = make_cfg(chat_setup, tmp_path / "dpo", "dpo", init_from=str(other), dpo={"reference_logps": ref})
    with pytest.raises(AstraiError, match="reference_sha256 differs.*dpo_reference"):
        train(cfg)


# ---- GRPO ----------------------------------------------------------------------------------------------------

def test_grpo_raises_the_reward(chat_setup, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "letters_a", lambda completion, record: completion.count("a") / 4)
    cfg = make_cfg(chat_setup, tmp_path / "grpo", "grpo", max_steps=24, optim=dict(lr=1e-2, min_lr=1e-2, warmup_steps=0),
                   grpo={"rewards": {"letters_a": 1.0}, "group_size": 8, "max_new_tokens": 6, "kl_coef": 0.01})
    train(cfg)
    m = metrics(cfg)
    first, last = np.mean([r["grpo/reward_mean"] for r in m[:4]]), np.mean([r["grpo/reward_mean"] for r in m[-4:]])
    assert last > first + 0.3, (first, last)
    assert {"grpo/kl", "grpo/clip_fraction", "grpo/reward_std", "grpo/zero_spread_fraction",
            "grpo/completion_length", "grpo/reward_errors"} <= set(m[-1])
    assert m[0]["grpo/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the starting policy


def test_grpo_reward_errors_stop_or_skip(chat_setup, tmp_path, monkeypatch):
    def boom(completion, record):
        raise ValueError("no answer")

    monkeypatch.setitem(REWARDS, "boom", boom)
    monkeypatch.setitem(REWARDS, "nan", lambda c, r: float("nan"))
    cfg = make_cfg(chat_setup, tmp_path / "a", "grpo", max_steps=2, grpo={"rewards": {"boom": 1.0}})
    with pytest.raises(AstraiError, match="reward 'boom' failed on prompt .*no answer"):
        train(cfg)
    # skip: a failed reward's group is dropped and counted; a step where every group failed has nothing to learn.
    cfg = make_cfg(chat_setup, tmp_path / "b", "grpo", max_steps=2, grpo={"rewards": {"nan": 1.0}, "on_reward_error": "skip"})
    with pytest.raises(AstraiError, match="every reward failed on every rank"):
        train(cfg)
    assert not (tmp_path / "b").exists()


def test_grpo_skips_and_counts_the_groups_whose_reward_failed(chat_setup, tmp_path, monkeypatch):
    """on_reward_error: skip. A group in which any reward failed gets zero advantage (no gradient from it, even from
    the completions that were scored), the failures are counted in grpo/reward_errors, and training goes on."""
    import contextlib

    from astrai_core.runtime.device import DataGroup
    from astrai_core.training.strategies import GRPOStrategy

    raised: set[int] = set()  # the records (objects) whose reward failed at least once

    def flaky(completion, record):  # fails on some completions of every other prompt
        if record["prompt"].count(" ") % 2 and len(completion) % 2:
            raised.add(id(record))
            raise ValueError("cannot score")
        return completion.count("a") / 4 + len(completion) / 10

    monkeypatch.setitem(REWARDS, "flaky", flaky)
    cfg = make_cfg(chat_setup, tmp_path / "out", "grpo", max_steps=3, batch_size=8,
                   grpo={"rewards": {"flaky": 1.0}, "on_reward_error": "skip", "group_size": 4, "temperature": 2.0})
    strategy = GRPOStrategy(cfg, 0, 1, torch.device("cpu"), sha256_file(cfg.tokenizer), contextlib.nullcontext())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    strategy.setup(model)
    items = np.arange(strategy.per_step)
    batches, stats = strategy.rollouts(0, model, items, DataGroup(0, 1))
    failed = [id(strategy.records[int(i)][0]) in raised for i in items]
    assert 0 < sum(failed) < len(failed), "the test needs both kinds of group"
    adv = torch.cat([b["adv"] for b in batches]).view(-1, 4)
    assert all((adv[g] == 0).all() for g, bad in enumerate(failed) if bad)
    assert any((adv[g] != 0).any() for g, bad in enumerate(failed) if not bad)  # the others still learn
    assert stats["grpo/reward_errors"] == (float(sum(failed)), float(len(failed)))
    # The whole loop: it trains to the end and logs the share of failed groups.
    assert train(cfg)["steps"] == 3
    errors = [r["grpo/reward_errors"] for r in metrics(cfg) if "grpo/reward_errors" in r]
    assert len(errors) == 3 and 0 < sum(errors) / 3 < 1, errors


def test_grpo_resume_inside_a_rollout_batch_is_exact(chat_setup, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "letters_a", lambda completion, record: completion.count("a") / 4)
    kw = dict(max_steps=6, grpo={"iterations": 2, "group_size": 4, "rewards": {"letters_a": 1.0}}, resume="auto",
              optim=dict(lr=1e-2, min_lr=1e-2, warmup_steps=0))
    ref = make_cfg(chat_setup, tmp_path / "ref" / "out", "grpo", **kw)
    train(ref)
    assert max(r["grpo/clip_fraction"] for r in metrics(ref)) > 0  # a second step on old rollouts: ratios move
    cfg = make_cfg(chat_setup, tmp_path / "run" / "out", "grpo", **kw)
    stopped = train(cfg, callbacks=default_callbacks() + [SigtermAt(step=2, micro=0)])
    assert stopped["steps"] == 3  # the next step reuses the rollouts sampled at step 3 (0-based 2)
    train(cfg)
    assert sha256_file(Path(cfg.out_dir) / "model.safetensors") == sha256_file(Path(ref.out_dir) / "model.safetensors")


def test_keep_groups_prefers_a_signal_in_sampling_order():
    from astrai_core.training.strategies import keep_groups

    signal = np.array([False, True, False, True, True, False])
    assert keep_groups(signal, 2).tolist() == [1, 3]  # the first two with a signal
    assert keep_groups(signal, 4).tolist() == [0, 1, 3, 4]  # three with a signal, then the first without
    assert keep_groups(signal, 6).tolist() == list(range(6))  # everything, in sampling order
    assert keep_groups(np.zeros(4, dtype=bool), 2).tolist() == [0, 1]


def test_grpo_dynamic_sampling_keeps_groups_with_spread_first_on_every_rank(chat_setup, tmp_path, monkeypatch):
    """oversample 3, 2 ranks x 2 micro-steps x 2 prompts: each rank generates 12 groups and trains on 4, those whose
    rewards differ first in sampling order, equal-reward ones filling up; the sampler takes 3 x 8 prompts a step
    whatever the rewards; every rank gets 2 micro-batches of 2 x group_size rows. scale_rewards false: the
    advantages are r - mean; clip_eps_high reaches the loss."""
    import contextlib

    from astrai_core.runtime.device import DataGroup
    from astrai_core.training.strategies import GRPOStrategy

    G, calls = 4, [0]
    signal_prompts: set[str] = set()

    def reward(completion, record):  # 1, 0, 1, 0 within a group of a signal prompt; 0.5 for every other one
        calls[0] += 1
        return float(calls[0] % 2) if record["prompt"] in signal_prompts else 0.5

    monkeypatch.setitem(REWARDS, "scripted", reward)
    cfg = make_cfg(chat_setup, tmp_path / "out", "grpo", batch_size=2, grad_accum=2,
                   grpo={"rewards": {"scripted": 1.0}, "group_size": G, "oversample": 3, "scale_rewards": False,
                         "iterations": 2, "clip_eps_high": 0.28})
    make = lambda rank: GRPOStrategy(cfg, rank, 2, torch.device("cpu"), sha256_file(cfg.tokenizer),
                                     contextlib.nullcontext())
    ranks = [make(0), make(1)]
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    items = ranks[0].sampler.indices(0, 3 * 8)
    candidates = [np.concatenate(s.my_slices(items, 6)) for s in ranks]  # each rank's 12 prompts in sampling order
    assert len(set(np.concatenate(candidates).tolist())) == 24
    prompt = lambda s, i: s.records[int(i)][0]["prompt"]
    # Rank 0: 5 prompts with spread, the first 4 kept; rank 1: only 2, filled up with the first 2 without.
    with_spread = {0: [1, 4, 5, 10, 11], 1: [3, 7]}
    expected = {0: [1, 4, 5, 10], 1: [0, 1, 3, 7]}
    for r, s in enumerate(ranks):
        signal_prompts |= {prompt(s, candidates[r][j]) for j in with_spread[r]}
    for r, s in enumerate(ranks):
        s.setup(model)
        stats = s.prepare(0, model, DataGroup(r, 1))  # no process group: this rank's statistics
        assert s.sampler.consumed == 3 * 8  # oversample x the step's prompts, fixed
        batches = s.micro_batches(0)
        assert [tuple(b.x.shape[:1]) for b in batches] == [(2 * G,), (2 * G,)]
        kept = [candidates[r][j] for j in expected[r]]
        for k, i in enumerate(kept):  # the rows of each kept group start with its prompt, in sampling order
            x, p = batches[k // 2].x, s.records[int(i)][1]
            assert all(x[(k % 2) * G + g, : len(p)].tolist() == p for g in range(G))
        adv = torch.cat([b.data["adv"] for b in batches]).view(-1, G)
        for k, j in enumerate(expected[r]):  # r - mean, unscaled: +-0.5 with spread, 0 without
            assert adv[k].tolist() == ([0.5, -0.5, 0.5, -0.5] if j in with_spread[r] else [0.0] * G)
        spread_kept = sum(j in with_spread[r] for j in expected[r])
        assert stats["grpo/zero_spread_fraction"] == (12.0 - len(with_spread[r]), 12.0)  # of those sampled
        assert stats["grpo/kept_zero_spread_fraction"] == (4.0 - spread_kept, 4.0)  # of those trained on
        s.prepare(1, model, DataGroup(r, 1))  # iterations 2: the same rollouts, nothing sampled
        assert s.sampler.consumed == 3 * 8
        s.prepare(2, model, DataGroup(r, 1))
        assert s.sampler.consumed == 2 * 3 * 8
    # clip_eps_high reaches the loss: a ratio of 1.25 with a positive advantage is not clipped.
    y = torch.tensor([[5]])
    logits = torch.zeros(1, 1, 320)
    data = {"y": y, "mask": y != IGNORE_INDEX, "adv": torch.tensor([1.0]), "ref_logp": torch.zeros(1, 1),
            "old_logp": token_logps(logits, y) - math.log(1.25)}
    assert ranks[0].loss(logits, Batch(logits, data, 1, 1))[1]["grpo/clip_fraction"].item() == 0.0


def test_grpo_with_every_option_on_is_deterministic_and_resumes_exactly(chat_setup, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "letters_a", lambda completion, record: float(completion.count("a") > 0))
    kw = dict(max_steps=4, resume="auto", optim=dict(lr=1e-2, min_lr=1e-2, warmup_steps=0),
              grpo={"iterations": 2, "group_size": 4, "rewards": {"letters_a": 1.0}, "oversample": 2,
                    "clip_eps_high": 0.28, "scale_rewards": False})
    runs = [make_cfg(chat_setup, tmp_path / name / "out", "grpo", **kw) for name in ("a", "b", "resumed")]
    train(runs[0])
    train(runs[1])
    assert train(runs[2], callbacks=default_callbacks() + [SigtermAt(step=2, micro=0)])["steps"] == 3
    train(runs[2])
    hashes = [sha256_file(Path(c.out_dir) / "model.safetensors") for c in runs]
    assert hashes[0] == hashes[1] == hashes[2] != sha256_file(chat_setup["base"] / "model.safetensors")
    m = [r for r in metrics(runs[0]) if "grpo/kept_zero_spread_fraction" in r]
    assert len(m) == 2  # logged on the steps that sampled
    assert all(r["grpo/kept_zero_spread_fraction"] <= r["grpo/zero_spread_fraction"] for r in m)
    assert any(r["grpo/kept_zero_spread_fraction"] < r["grpo/zero_spread_fraction"] for r in m), m


# ---- two-stage KL-regularized pretraining ----------------------------------------------------------------------

def _seq_cfg(core_tiny_data, out, **kw):
    base = dict(model={**MODEL, "vocab_size": 300, "max_seq_len": 32}, train_data=str(core_tiny_data["train"]),
                val_data=str(core_tiny_data["val"]), tokenizer=str(core_tiny_data["tokenizer"]), out_dir=str(out),
                seq_len=32, batch_size=4, max_steps=10, log_every=1, device="cpu", resume="auto",
                optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=2),
                two_stage={"stage1_tokens": 4 * 4 * 32, "beta": 0.5,
                           "stage2_data": {str(core_tiny_data["train"]): 1.0, str(core_tiny_data["val"]): 1.0}})
    return TrainConfig.model_validate({**base, **kw})


def test_two_stage_switches_to_kl_against_a_frozen_snapshot(core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = _seq_cfg(core_tiny_data, tmp_path / "out")
    train(cfg)
    m = metrics(cfg)
    assert all("train/kl" not in r for r in m[:4])  # stage 1: plain language modeling (4 steps)
    assert m[4]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the switch: the reference is the model itself
    assert all(r["train/kl"] > 1e-6 for r in m[6:])  # then the policy moves away and pays for it
    for r in m[4:]:
        assert r["train/loss"] == pytest.approx(r["train/ce"] + 0.5 * r["train/kl"], rel=1e-5)


def test_two_stage_resume_after_the_switch_is_exact(core_tiny_data, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    ref = _seq_cfg(core_tiny_data, tmp_path / "ref" / "out")
    train(ref)
    cfg = _seq_cfg(core_tiny_data, tmp_path / "run" / "out")
    assert train(cfg, callbacks=default_callbacks() + [SigtermAt(step=6, micro=0)])["steps"] == 7
    train(cfg)
    assert sha256_file(Path(cfg.out_dir) / "model.safetensors") == sha256_file(Path(ref.out_dir) / "model.safetensors")


def test_reward_functions_by_hand():
    from astrai_core.training.rewards import exact_answer, option_prefix, resolve_reward, valid_option

    record = {"answer": "HAMLET", "options": ["HAMLET", "OPHELIA", "HORATIO"]}
    assert exact_answer(" HAMLET\n", record) == 1.0 and exact_answer("OPHELIA", record) == 0.0
    assert valid_option("OPHELIA", record) == 1.0 and valid_option("OPHEL", record) == 0.0
    assert option_prefix("HAM", record) == pytest.approx(3 / 6)  # half of HAMLET copied
    assert option_prefix("HORATIO!", record) == pytest.approx(7 / 8)  # extra characters cost
    assert option_prefix("xyz", record) == 0.0 and option_prefix("OPHELIA", record) == 1.0
    assert resolve_reward("astrai_core.training.rewards:exact_answer") is exact_answer  # a user's own function by name
    with pytest.raises(AstraiError, match="unknown reward 'nope'"):
        resolve_reward("nope")


def test_dpo_pairs_count_only_response_tokens(chat_setup):
    from astrai_core.data.batches import pair_batch

    data = Documents(str(chat_setup["chat"] / "dpo_train.h5"), sha256_file(chat_setup["tokenizer"]), 320)
    batch = pair_batch(data, np.array([0, 3]), torch.device("cpu"))
    chat = load_chat(chat_setup["tokenizer"])
    records = [json.loads(line) for line in (chat_setup["root"] / "records" / "dpo_train.jsonl").read_text().splitlines()]
    kept = [r for r in records if max(len(chat.encode([{"role": "user", "content": r["prompt"]},
                                                       {"role": "assistant", "content": r[k]}])[0])
                                      for k in ("chosen", "rejected")) <= 65]
    eot = "<|end_of_turn|>"
    y = batch["y"]
    assert y.shape[0] == 4 and (batch["x"][y == IGNORE_INDEX].numel() > 0)  # prompt + padding masked out
    for row, (pair, key) in enumerate([(0, "chosen"), (3, "chosen"), (0, "rejected"), (3, "rejected")]):
        targets = [int(t) for t in y[row] if t != IGNORE_INDEX]
        assert chat.tokenizer.decode(targets, skip_special_tokens=False) == kept[pair][key] + eot
