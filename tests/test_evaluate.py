"""Held-out metrics, their intervals and the stage checks against hand-computed or published values; the evaluate
stage on a tiny chain."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from astrai_core.scoring.metrics import sequence_nll
from astrai_core.scoring.statistics import Z95, paired_difference, pass_at_k, summarize, unigram_nll, wilson_interval
from tasks.evaluation.checks import Check, flag_tags, grpo_why, stage_checks
from tasks.evaluation.intervals import pass_metrics
from tasks.evaluation.report import evaluation_markdown
from tasks.run.table import TRAINING
from test_posttrain import MODEL, chat_setup  # noqa: F401  (a module fixture: tokenizer, chat files, random model)


class Uniform(torch.nn.Module):
    """Assigns equal probability to every token: NLL is exactly ln(V) per prediction."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.zeros(*idx.shape, self.vocab)


class Oracle(torch.nn.Module):
    """Predicts token (x + 1) % V with near-certainty: NLL ~0 on the sequence 0, 1, 2, ..."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.nn.functional.one_hot((idx + 1) % self.vocab, self.vocab).float() * 50.0


def test_sequence_nll_scores_every_token_but_the_first_once():
    tokens = np.arange(103) % 7
    for seq_len, batch in ((10, 3), (7, 1), (200, 4), (1, 5)):
        nll, n = sequence_nll(Uniform(7), tokens, seq_len, batch)
        assert n == 102
        assert math.isclose(nll, 102 * math.log(7), rel_tol=1e-6)
    nll, _ = sequence_nll(Oracle(7), tokens, 16, 2)
    assert nll < 1e-6 * 102


def test_unigram_baseline_is_the_split_entropy():
    tokens = np.array([5, 0, 0, 1, 1, 1, 1])  # targets: 0,0,1,1,1,1 -> p(0)=1/3, p(1)=2/3
    nll, n = unigram_nll(tokens, vocab_size=8)
    assert n == 6
    assert math.isclose(nll, -(2 * math.log(1 / 3) + 4 * math.log(2 / 3)))


def test_bits_per_char_and_perplexity():
    m = summarize(nll=100 * math.log(2), n_tokens=50, n_chars=200)
    assert math.isclose(m["bits_per_char"], 0.5)
    assert math.isclose(m["perplexity"], 4.0)
    assert math.isclose(m["loss"], 2 * math.log(2))


# ---- intervals, pass@k and the paired comparison, against published or hand-computed values ------------------------


@pytest.mark.parametrize("k, n, low, high", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table II, Wilson score method
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_interval_matches_published_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert (round(lo, 4), round(hi, 4)) == (low, high)


def test_wilson_interval_at_none_and_all_right():
    # k = 0: [0, z^2 / (n + z^2)]; k = n: [n / (n + z^2), 1] (from the formula with p = 0 and p = 1)
    z2 = Z95 ** 2
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + z2), 1.0))
    assert wilson_interval(10, 10)[1] <= 1.0 and wilson_interval(0, 10)[0] >= 0.0
    assert wilson_interval(0, 500)[1] == pytest.approx(0.00763, abs=1e-5)  # 0 of 500 still allows ~0.8%


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # 1 - C(6,4)/C(8,4)
    assert pass_at_k(5, 1, 2) == pytest.approx(1 - 6 / 10)  # 1 - C(4,2)/C(5,2)
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share right
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than k wrong samples: any k of them hold a right one


def test_pass_at_k_means_and_their_wilson_interval():
    # 3 questions, 4 samples each, right 0, 2 and 4 times: pass@1 = (0 + 1/2 + 1) / 3, pass@2 = (0 + 5/6 + 1) / 3
    m = pass_metrics([0, 2, 4], samples=4, k=2)
    assert m["pass_at_1"] == pytest.approx(0.5) and m["pass_at_k"] == pytest.approx(11 / 18)
    assert (m["pass_at_k_low"], m["pass_at_k_high"]) == pytest.approx(wilson_interval(11 / 6, 3))
    # Never right: the interval still allows what 500 questions cannot rule out (not a point at 0).
    m = pass_metrics([0] * 500, samples=8, k=4)
    assert m["pass_at_1"] == 0 and m["pass_at_k_high"] == pytest.approx(Z95 ** 2 / (500 + Z95 ** 2))


def _paired(both: int, only_after: int, only_before: int, neither: int) -> tuple[list[int], list[int]]:
    before = [1] * both + [0] * only_after + [1] * only_before + [0] * neither
    after = [1] * both + [1] * only_after + [0] * only_before + [0] * neither
    return before, after


def test_paired_difference_matches_the_published_newcombe_interval():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8 example (Cavo et al.
    # 2012): table [[59, 6], [16, 80]], Newcombe square-and-add: -0.0621 (95% CI -0.1186 to -0.0046).
    before, after = _paired(59, 6, 16, 80)
    d, low, high = paired_difference(before, after)
    assert (round(d, 4), round(low, 4), round(high, 4)) == (-0.0621, -0.1186, -0.0046)
    # Swapping the models swaps the sign.
    assert paired_difference(after, before) == pytest.approx((-d, -high, -low))


def test_paired_difference_rule_beats_only_beyond_the_interval():
    # Identical results: difference 0, the interval straddles it.
    d, low, high = paired_difference(*_paired(100, 0, 0, 400))
    assert d == 0 and low < 0 < high
    # 12 more right and none lost out of 500: a clear gain.
    assert paired_difference(*_paired(20, 12, 0, 468))[1] > 0
    # Net +6 of 500 but with 30 won and 24 lost: noise, not a gain.
    d, low, high = paired_difference(*_paired(20, 30, 24, 426))
    assert d == pytest.approx(6 / 500) and low < 0 < high


# ---- checks and flags -------------------------------------------------------------------------------------------------


def _items(**results):
    return {"task_accuracy": {s: r[0] for s, r in results.items()},
            "preference_accuracy": {s: r[1] for s, r in results.items()}}


def test_each_stage_is_checked_against_its_starting_model_and_failures_are_flagged():
    none, some, more = [0] * 500, [1] * 40 + [0] * 460, [1] * 80 + [0] * 420
    items = _items(pretrain=(none, some), sft=(some, some), grpo=(some, some))  # dpo disabled: grpo starts from sft
    metrics = {"final_model": "grpo", "pretrain/test_bits_per_char": 2.0, "grpo/test_bits_per_char": 2.2,
               "unigram_bits_per_char": 4.0}
    checks = stage_checks(["pretrain", "sft", "grpo"], items, metrics, TRAINING)
    assert [(c.stage, c.start, c.metric, c.rule, c.passed) for c in checks] == [
        ("sft", "pretrain", "task_accuracy", "raise", True),
        ("grpo", "sft", "task_accuracy", "raise", False),  # identical results: not beyond the interval
        ("grpo", "pretrain", "test_bits_per_char", "forget", False),  # +10% bits/char
    ]
    assert checks[2].difference == pytest.approx(0.1)
    # DPO must raise preference accuracy and keep task accuracy: a drop beyond the interval is flagged.
    items = _items(pretrain=(none, none), sft=(more, some), dpo=(some, more))
    metrics = {"final_model": "dpo", "pretrain/test_bits_per_char": 2.0, "dpo/test_bits_per_char": 2.05,
               "unigram_bits_per_char": 4.0}
    checks = stage_checks(["pretrain", "sft", "dpo"], items, metrics, TRAINING)
    assert [(c.stage, c.metric, c.rule, c.passed) for c in checks] == [
        ("sft", "task_accuracy", "raise", True), ("dpo", "preference_accuracy", "raise", True),
        ("dpo", "task_accuracy", "keep", False), ("dpo", "test_bits_per_char", "forget", True)]

    tags = flag_tags(checks)
    assert list(tags) == ["astrai.flag.dpo"] and "dpo lowered beyond the interval task_accuracy" in tags["astrai.flag.dpo"]
    report = evaluation_markdown(metrics, ["pretrain", "sft", "dpo"], checks)
    assert "**⚠ 1 flag:**" in report and f"⚠ **FLAG** {checks[2].describe()}" in report
    assert "| dpo | sft | task accuracy | not fall beyond the interval | -0.0800 |" in report
    assert report.count("**no ⚠ FLAG**") == 1


def test_a_grpo_flag_says_what_grpo_had_to_learn_from():
    some = [1] * 40 + [0] * 460
    items = _items(pretrain=([0] * 500, some), sft=(some, some), grpo=(some, some))
    metrics = {"final_model": "grpo", "pretrain/test_bits_per_char": 2.0, "grpo/test_bits_per_char": 2.0,
               "pass_samples": 8, "pass_k": 8, "sft/pass_at_k": 0.576, "sft/task_accuracy": 0.08}
    curves = {"grpo": [{"step": 1, "grpo/zero_spread_fraction": 0.75}, {"step": 2, "train/loss": 0.1},
                       {"step": 3, "grpo/zero_spread_fraction": 0.25}]}
    checks = stage_checks(["pretrain", "sft", "grpo"], items, metrics, TRAINING, curves)
    assert [c.why for c in checks] == ["", grpo_why(metrics, "sft", curves["grpo"]), ""]  # only the failed GRPO one
    assert checks[1].describe() == (
        "grpo did not beat its starting model sft on task_accuracy: +0.0000 (95% interval -0.0075 to +0.0075). Why: "
        "GRPO re-weights the answers its starting model samples, and sft answered 0.576 of the held-out questions "
        "right in 8 samples (pass@8) against 0.080 greedily; 50% of its rollout groups had equal rewards, which "
        "give no gradient")
    assert grpo_why({}, "sft", []) == ""  # nothing known: nothing said


def test_all_checks_passed_reads_so():
    checks = [Check("sft", "pretrain", "task_accuracy", "raise", 0.1, 0.05, 0.15, True)]
    report = evaluation_markdown({"final_model": "sft", "unigram_bits_per_char": 4.0}, ["pretrain", "sft"], checks)
    assert "no flags" in report and "FLAG" not in report


# ---- the stage on a tiny chain: intervals, per-item results, plots, and a flag in the log, the report and MLflow ----


@pytest.fixture
def tiny_chain(chat_setup, core_write_packed, tmp_path):
    """A project whose sft model is the pretrained model unchanged (so SFT cannot beat it) and dpo/grpo disabled."""
    from tokenizers import Tokenizer

    from astrai_core.runtime.io import sha256_file
    from tasks.run.table import CHAT, PACKED, model_dir

    root = tmp_path / "project"
    shutil.copytree(chat_setup["chat"], root / CHAT)
    questions = [json.loads(line) for line in (root / CHAT / "grpo_test.jsonl").read_text().splitlines()]
    (root / CHAT / "grpo_test.jsonl").write_text("".join(
        json.dumps(q | {"task": "who_says" if i % 3 else "other"}) + "\n" for i, q in enumerate(questions)))
    tok = chat_setup["tokenizer"]
    ids = Tokenizer.from_file(str(tok)).encode("The king loves the night. " * 40).ids
    core_write_packed(root / PACKED / "test.h5", ids, tokenizer_sha256=sha256_file(tok), vocab_size=MODEL["vocab_size"])
    for stage in ("pretrain", "sft"):
        shutil.copytree(chat_setup["base"], model_dir(root, stage))
        (model_dir(root, stage) / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "train/loss": 5.0 - s / 10, **({"val/loss": 5.0 - s / 12} if s % 2 else {})}) + "\n"
            for s in range(1, 9)))
    # A held-out "play" in the corpus's layout: the lm-eval tasks' items (evaluate.lm_eval_tasks) come from it.
    speakers, lines = ("ROMEO", "JULIET", "NURSE", "FRIAR", "TYBALT"), ("The king loves the night.", "What light?")
    play = "\n".join(f"SCENE {'I' * (s + 1)}.\n\n" + "\n\n".join(
        f"{speakers[(s + i) % 5 if i % 3 else (s * i) % 5]}.\n{lines[i % 2]}" for i in range(10)) + "\n"
        for s in range(3))
    (root / "data/corpus").mkdir(parents=True)
    (root / "data/corpus/test.jsonl").write_text(json.dumps({"id": "play", "text": play}) + "\n")
    from tasks.run.params import parse_params

    params = parse_params({"model": MODEL, "tokenizer": {"vocab_size": 320}, "pretrain": {"seq_len": 64},
                           "grpo": {"objective": {"max_new_tokens": 6}, "enabled": False}, "dpo": {"enabled": False},
                           "evaluate": {"batch_size": 4, "prompts": ["Who"], "max_new_tokens": 4, "task_examples": 24,
                                        "pass_samples": 4, "pass_k": 2}})
    return root, params


def test_evaluate_stage_reports_intervals_and_flags_a_stage_that_did_not_improve(tiny_chain, tmp_path, monkeypatch,
                                                                                capsys):
    import mlflow

    from tasks.stages.runner import run_stage

    root, params = tiny_chain
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_stage("evaluate", params, root)
    out = capsys.readouterr().out

    # The flag: a WARNING line in the stage's log, a tag on its MLflow run, a mark in evaluation.md.
    assert "WARNING: evaluate: sft did not beat its starting model pretrain on task_accuracy: +0.0000" in out, out
    ev = root / "data" / "evaluate"
    report = (ev / "evaluation.md").read_text()
    assert "⚠ **FLAG** sft did not beat its starting model pretrain on task_accuracy" in report
    run = mlflow.MlflowClient().search_runs(mlflow.get_experiment_by_name("astrai").experiment_id)[0]
    assert run.data.tags["astrai.flag.sft"].startswith("sft did not beat its starting model pretrain on task_accuracy")
    assert {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)} >= {
        "chain.png", "curves.png", "evaluation.md", "items.json", "metrics.json", "checks.json"}

    # Every accuracy with its Wilson interval and n, pass@k, per-family accuracy; per-item results for pairing.
    metrics = json.loads((ev / "metrics.json").read_text())
    items = json.loads((ev / "items.json").read_text())
    assert metrics["n/task_accuracy"] == 24 and metrics["n/task_accuracy.who_says"] == 16
    for stage in ("pretrain", "sft"):
        right = items["task_accuracy"][stage]
        assert len(right) == 24 and metrics[f"{stage}/task_accuracy"] == sum(right) / 24
        assert (metrics[f"{stage}/task_accuracy_low"], metrics[f"{stage}/task_accuracy_high"]) == \
            pytest.approx(wilson_interval(sum(right), 24))
        assert len(items["preference_accuracy"][stage]) == metrics["n/preference_accuracy"] > 0
        counts = items["pass_correct"][stage]
        assert metrics[f"{stage}/pass_at_k"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in counts) / 24)
        assert metrics[f"{stage}/pass_at_1_low"] <= metrics[f"{stage}/pass_at_1"] <= metrics[f"{stage}/pass_at_1_high"]
        assert f"{stage}/task_accuracy.other_low" in metrics
    # Same weights, same items: the same results, and the old keys still there for dvc metrics / exp show.
    assert items["task_accuracy"]["pretrain"] == items["task_accuracy"]["sft"]
    assert metrics["final_model"] == "sft" and metrics["test_bits_per_char"] == metrics["sft/test_bits_per_char"]
    assert metrics["flags"] == 1
    # Free text: each model continued the same test windows; the same weights loop (or not) alike, so no flag.
    assert metrics["n/loop_free_rate"] == len(items["loop_free_rate"]["sft"]) > 0
    assert items["loop_free_rate"]["pretrain"] == items["loop_free_rate"]["sft"]
    free = [c for c in json.loads((ev / "checks.json").read_text()) if c["rule"] == "free"]
    assert [(c["stage"], c["start"], c["passed"]) for c in free] == [("sft", "pretrain", True)]
    assert "pass@2 (higher is better, n=24)" in report and "| model | other (n=8) | who_says (n=16) |" in report
    for png in ("chain.png", "curves.png"):
        assert (ev / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["model"] for r in json.loads((ev / "chain.json").read_text())] == ["pretrain", "sft"]
    assert len(json.loads((ev / "curves" / "sft.json").read_text())) == 8

    # The lm-eval tasks, run in process on each model: their scores with intervals in metrics.json (and MLflow),
    # per-item results for pairing, a column of evaluation.md and a "keep" row of the checks table.
    n = metrics["n/astrai_next_speaker_acc"]
    assert n == len(items["astrai_next_speaker_acc"]["sft"]) > 10 and "astrai_next_speaker_acc" in items["item_sets"]
    for stage in ("pretrain", "sft"):
        right = items["astrai_next_speaker_acc"][stage]
        assert metrics[f"{stage}/astrai_next_speaker_acc"] == sum(right) / n
        assert (metrics[f"{stage}/astrai_next_speaker_acc_low"], metrics[f"{stage}/astrai_next_speaker_acc_high"]) \
            == pytest.approx(wilson_interval(sum(right), n))
        assert metrics[f"{stage}/astrai_speech_ppl_bits_per_byte"] > 0
        assert run.data.metrics[f"{stage}.astrai_next_speaker_acc"] == metrics[f"{stage}/astrai_next_speaker_acc"]
    assert f"lm-eval who speaks next acc (higher is better, n={n})" in report
    assert "| sft | pretrain | lm-eval who speaks next acc | not fall beyond the interval | +0.0000 |" in report
    assert "evaluate: sft kept astrai_next_speaker_acc against its starting model pretrain: +0.0000" in out


def test_the_prefect_artifact_embeds_the_plots_as_data_uris(tmp_path):
    import base64

    from flows.pipeline import embed_images

    png = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
    (tmp_path / "chain.png").write_bytes(png)
    out = embed_images("# t\n\n![Each metric](chain.png)\n\n![missing](gone.png)\n", tmp_path)
    prefix = "![Each metric](data:image/png;base64,"
    assert prefix in out and "![missing](gone.png)" in out  # a missing file stays a plain link
    encoded = out.split(prefix)[1].split(")")[0]
    assert base64.b64decode(encoded) == png


def test_plots_label_every_axis_draw_no_empty_panel_and_show_the_reference_lines():
    from tasks.evaluation.plots import chain_figure, curves_figure

    curves = {"pretrain": [{"step": s, "train/loss": 5 / s, "val/loss": 5.2 / s} for s in range(1, 6)],
              "sft": [{"step": s, "train/loss": 2 / s} for s in range(1, 6)],
              "grpo": [{"step": s, "grpo/reward_mean": 0.1 * s, "val/reward": 0.3, "val/task_accuracy": 0.3}
                       for s in range(1, 6)]}
    fig = curves_figure(curves)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["pretrain: loss", "sft: loss", "grpo: score"]  # grpo logged no loss here: no empty panel
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.has_data()
        styles = [line.get_linestyle() for line in ax.get_lines()]
        assert len(set(styles)) == len(styles)  # the held-out reward is not hidden under the same-valued accuracy
    metrics = {"pretrain/test_bits_per_char": 2.4, "sft/test_bits_per_char": 2.45, "unigram_bits_per_char": 3.9,
               "pretrain/task_accuracy": 0.0, "sft/task_accuracy": 0.4}
    fig = chain_figure(["pretrain", "sft"], metrics)
    bpc = next(ax for ax in fig.axes if "bits" in ax.get_title())
    ys = sorted(line.get_ydata()[0] for line in bpc.get_lines() if line.get_label() != "model"
                and not line.get_label().startswith("_"))
    assert ys == pytest.approx([2.4 * 1.05, 3.9])  # the forgetting limit and the unigram baseline
    assert all(ax.get_ylabel() for ax in fig.axes) and len(fig.axes) == 2


def test_an_unknown_lm_eval_task_is_refused_by_name():
    from astrai_core.runtime.errors import AstraiError
    from tasks.run.params import parse_params

    with pytest.raises(AstraiError, match=r"evaluate\.lm_eval_tasks: unknown lm-eval task 'nope'; one of: "
                                          r"astrai_next_speaker, astrai_speech_ppl"):
        parse_params({"evaluate": {"lm_eval_tasks": ["nope"]}})


def test_each_prompts_sample_has_its_own_draws(tmp_path):
    """Issue 50 (21): the samples of two prompts ended in the same words (one seed for every prompt: the same draws).
    The same prompt twice: two sampled texts that differ (greedy ones stay equal), and the same file on a rerun."""
    from astrai_core.tokenizer.bpe import train_tokenizer
    from conftest import _core_text, sharp_random_model
    from tasks.evaluation.samples import samples_markdown
    from tasks.run.schema import Params

    tok = train_tokenizer([_core_text(200, seed=1)], vocab_size=300)
    model = sharp_random_model(vocab_size=tok.get_vocab_size(), dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                               max_seq_len=64)
    p = Params(evaluate={"max_new_tokens": 24}).evaluate
    settings = dict(temperature=p.temperature, max_new_tokens=p.max_new_tokens, top_k=p.top_k, seed=p.seed)
    text = samples_markdown(model, tok, ["the king", "the king"], **settings)
    blocks = text.split("```")[1::2]  # greedy, sampled; greedy, sampled
    assert blocks[0] == blocks[2] and blocks[1] != blocks[3], text
    assert samples_markdown(model, tok, ["the king", "the king"], **settings) == text


def test_the_final_model_must_keep_the_pretrained_models_free_text():
    """Issue 50 (19): the final model's share of free continuations without a loop against the pretrained model's:
    a fall beyond the interval is a flag, one inside it is not."""
    clean, looping = [1] * 200, [1] * 150 + [0] * 50
    metrics = {"final_model": "sft", "pretrain/test_bits_per_char": 2.0, "sft/test_bits_per_char": 2.0,
               "unigram_bits_per_char": 4.0}
    for final, flagged in ((clean[:196] + [0] * 4, False), (looping, True)):
        items = {"loop_free_rate": {"pretrain": clean, "sft": final}}
        check = stage_checks(["pretrain", "sft"], items, metrics, TRAINING)[-1]
        assert (check.stage, check.start, check.metric, check.rule, check.passed) == \
            ("sft", "pretrain", "loop_free_rate", "free", not flagged)
    assert check.describe().startswith("sft (final model) lost beyond the interval pretrain's share of free text "
                                       "without a loop")
    assert "| sft | pretrain | free text without a loop | not fall beyond the interval | -0.2500 |" in \
        evaluation_markdown(metrics | {"pretrain/loop_free_rate": 1.0, "sft/loop_free_rate": 0.75},
                            ["pretrain", "sft"], [check])


def test_a_model_that_loops_on_an_answer_is_seen_looping():
    """loop_free on a real model: one whose every next token is the same ("no no no no") loops on every prompt;
    a random model's continuations do not."""
    import numpy as np
    import torch

    from conftest import sharp_random_model
    from tasks.evaluation.free_text import free_prompts, loop_free

    model = sharp_random_model(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    prompts = free_prompts(np.random.default_rng(0).integers(0, 300, 2000), 24)
    assert sum(loop_free(model, prompts, 40, temperature=0.8, top_k=40, seed=0)) >= 22
    model.lm_head = torch.nn.Linear(64, 300)  # every position's logits favour token 7: "no no no no"
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[7] = 10.0
    assert loop_free(model, prompts, 40, temperature=0.8, top_k=40, seed=0) == [0] * len(prompts)
