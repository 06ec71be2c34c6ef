"""params.yaml validation and the `astrai` CLI's handling of bad input (one line, non-zero exit, no output)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astrai_core.runtime.errors import AstraiError
from tasks.run.params import load_params
from tasks.run.schema import Params

ROOT = Path(__file__).resolve().parents[1]
ASTRAI = [sys.executable, "-m", "astrai.cli"]


def test_shipped_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.model.vocab_size >= p.tokenizer.vocab_size
    assert len(p.digest()) == 64


@pytest.mark.parametrize("override, message", [
    ({"pretrain.max_stepz": 3}, "pretrain.max_stepz: unknown key"),
    ({"register.model_name": "x@y"}, "register.model_name: 'x@y': a registered model's name must be non-empty"),
    ({"pretrain.optim.lr": -1}, "pretrain.optim.lr: Input should be greater than 0"),
    ({"model.n_kv_heads": 3}, "n_heads (4) must be divisible by n_kv_heads (3)"),
    ({"tokenizer.vocab_size": 4096}, "must be >= tokenizer.vocab_size (4096)"),
    ({"pretrain.dtype": "fp8"}, "pretrain.dtype"),
    ({"corpuss": {}}, "corpuss: unknown key"),
    # cross-field checks of the core's configs, at parse time (astrai_core/training/config.py)
    ({"pretrain.optim.min_lr": 0.1}, "pretrain.optim: min_lr (0.1) exceeds lr (0.003)"),
    ({"sft.optim": {"lr": 0.001, "min_lr": 0.01}}, "sft.optim: min_lr (0.01) exceeds lr (0.001)"),
    ({"pretrain.seq_len": 300}, "pretrain: seq_len (300) exceeds model.max_seq_len (256)"),
    ({"tokenizer.vocab_size": 5}, "tokenizer.vocab_size: Input should be greater than or equal to 263"),
    ({"grpo.objective.rewards": {"exact_answr": 1.0}}, "grpo.objective.rewards: unknown reward 'exact_answr'"),
    ({"grpo.objective.rewards": {"no_such_module:fn": 1.0}},
     "grpo.objective.rewards: reward 'no_such_module:fn': cannot import"),
    ({"dpo.objective.label_smoothing": 0.7}, "dpo.objective.label_smoothing: Input should be less than 0.5"),
    ({"dpo.objective.nll_coef": -1}, "dpo.objective.nll_coef: Input should be greater than or equal to 0"),
    ({"grpo.group_size": 4}, "grpo.group_size: unknown key"),  # GRPO's own settings are under objective
    ({"grpo.objective.clip_eps_high": 0}, "grpo.objective.clip_eps_high: Input should be greater than 0"),
    ({"grpo.objective.clip_eps_high": 0.1}, "grpo.objective: clip_eps_high (0.1) is below clip_eps (0.2)"),
    ({"grpo.objective.clip_eps_high": 0.28, "grpo.objective.iterations": 1},
     "grpo.objective: clip_eps_high (0.28) has no effect with iterations 1"),
    ({"grpo.objective.oversample": 0}, "grpo.objective.oversample: Input should be greater than 0"),
    ({"dpo.rejected": "random"}, "dpo.rejected: Input should be 'on_policy' or 'static'"),
    ({"chat_data.dpo": "my_pairs.jsonl"}, "dpo.rejected: on_policy needs pairs whose chosen reply is the one right "
                                          "answer (chat_data.dpo: demo); set dpo.rejected: static for my_pairs.jsonl"),
    # the optimizer's bounds, at parse time (torch would raise them inside the ranks, or train on with nonsense)
    ({"pretrain.optim.beta1": 1.5}, "pretrain.optim.beta1: Input should be less than 1"),
    ({"sft.optim.beta2": -0.1}, "sft.optim.beta2: Input should be greater than or equal to 0"),
    ({"pretrain.optim.warmup_steps": -1}, "pretrain.optim.warmup_steps: Input should be greater than or equal to 0"),
    ({"pretrain.optim.warmup_steps": 451}, "pretrain: optim.warmup_steps (451) exceeds max_steps (450)"),
    ({"dpo.optim.weight_decay": -0.1}, "dpo.optim.weight_decay: Input should be greater than or equal to 0"),
    ({"pretrain.optim.grad_clip": -1}, "pretrain.optim.grad_clip: Input should be greater than or equal to 0"),
    ({"grpo.optim.min_lr": -1e-4}, "grpo.optim.min_lr: Input should be greater than or equal to 0"),
])
def test_bad_params_name_the_key(override, message):
    with pytest.raises(AstraiError) as e:
        load_params(ROOT / "params.yaml", override)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(str(ROOT / "params.yaml"))


def test_yaml_syntax_error_names_the_line(tmp_path):
    (tmp_path / "params.yaml").write_text("corpus:\n  source: x\n pack: [\n")
    with pytest.raises(AstraiError, match=rf"^{tmp_path / 'params.yaml'}:3: not valid YAML"):
        load_params(tmp_path / "params.yaml")


def test_sections_resolve_into_the_core_configs():
    """Each training section is the core's RunSettings plus its method's `objective`: what it sets reaches the
    stage's TrainConfig, and what it leaves out takes the core's one default. model.vocab_size left out is the
    tokenizer's."""
    from astrai_core.training.config import RunSettings
    from tasks.run.configs import dpo_pairs, train_config

    p = load_params(ROOT / "params.yaml", {"sft.label_smoothing": 0.1, "dpo.objective.label_smoothing": 0.2,
                                           "grpo.objective.kl_coef": 0.5, "grpo.max_steps": 9,
                                           "grpo.objective.oversample": 2, "grpo.objective.clip_eps_high": 0.28})
    sft, dpo, grpo = train_config(p, "sft", ROOT), train_config(p, "dpo", ROOT), train_config(p, "grpo", ROOT)
    assert (sft.label_smoothing, sft.batch_size, sft.seq_len) == (0.1, p.sft.batch_size, p.pretrain.seq_len)
    assert (dpo.dpo.label_smoothing, dpo.label_smoothing) == (0.2, 0.0)  # DPO's own, not the token loss's
    assert (dpo.dpo.beta, dpo.dpo.nll_coef) == (p.dpo.objective.beta, p.dpo.objective.nll_coef)
    assert (grpo.grpo.kl_coef, grpo.max_steps, grpo.grpo.group_size) == (0.5, 9, p.grpo.objective.group_size)
    assert (grpo.grpo.oversample, grpo.grpo.clip_eps_high, grpo.grpo.scale_rewards) == (2, 0.28, True)
    assert train_config(p, "grpo", ROOT).keep_checkpoints == RunSettings().keep_checkpoints
    assert train_config(p, "grpo", ROOT).init_from == str(ROOT / "data" / "dpo")
    skip = load_params(ROOT / "params.yaml", {"dpo.enabled": False})
    assert train_config(skip, "grpo", ROOT).init_from == str(ROOT / "data" / "sft")  # the previous enabled stage
    # On-policy pairs are the dpo_reference stage's; static ones chat_data's (and evaluate's when dpo is off).
    static = load_params(ROOT / "params.yaml", {"dpo.rejected": "static"})
    assert (dpo.train_data, train_config(static, "dpo", ROOT).train_data) == (
        str(ROOT / "data/dpo_reference/dpo_train.h5"), str(ROOT / "data/chat/dpo_train.h5"))
    assert dpo_pairs(skip, ROOT, "test") == ROOT / "data/chat/dpo_test.h5"
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    del raw["model"]["vocab_size"]
    raw["tokenizer"]["vocab_size"] = 300
    assert Params.model_validate(raw).model.vocab_size == 300


def test_overrides_apply_and_digest_changes():
    base = load_params(ROOT / "params.yaml")
    p = load_params(ROOT / "params.yaml", {"pretrain.max_steps": 70, "pretrain.optim.lr": 0.001})
    assert (p.pretrain.max_steps, p.pretrain.optim.lr) == (70, 0.001)
    assert p.digest() != base.digest()
    assert load_params(ROOT / "params.yaml", {"pretrain.max_steps": 70}).digest() != base.digest()
    # The digest is of the resolved params: a default written out, or keys in another order, change nothing.
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    explicit = {**raw, "sft": {**raw["sft"], "keep_checkpoints": 2}}  # RunSettings' default
    assert "keep_checkpoints" not in raw["sft"] and Params.model_validate(explicit).digest() == base.digest()
    reordered = dict(reversed(list(raw.items())))
    assert Params.model_validate(reordered).digest() == base.digest()


def _cli(args, cwd, **env):
    e = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{cwd}/mlflow.db", **env)
    return subprocess.run(ASTRAI + args, cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def test_cli_typo_in_params_is_one_line_and_nonzero(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["pretrain"]["batch_sise"] = 4
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _cli(["stage", "corpus"], tmp_path)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == "astrai: error: params.yaml: pretrain.batch_sise: unknown key"
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "data").exists()


def test_a_misspelt_train_config_key_is_named_not_what_it_hides(tmp_path):
    """`astrai train --config` with `modle:` for `model:`: the unknown key is what the one line names (the fields it
    leaves missing are not the mistake)."""
    (tmp_path / "cfg.yaml").write_text("modle: {dim: 32}\n")
    out = _cli(["train", "--config", "cfg.yaml"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "astrai: error: cfg.yaml: modle: unknown key (and 3 more)"


def test_cli_pipeline_checks_params_before_prefect_starts(tmp_path):
    """A bad override stops `astrai pipeline` with the key named, before a Prefect server is started."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    out = _cli(["pipeline", "--set", "pretrain.optim.min_lr=0.5"], tmp_path, PREFECT_HOME=str(tmp_path / "prefect"))
    assert out.returncode == 2
    assert out.stderr.strip() == "astrai: error: params.yaml: pretrain.optim: min_lr (0.5) exceeds lr (0.003)"
    assert not (tmp_path / "prefect").exists() and not (tmp_path / "data").exists()


def test_cli_missing_corpus_is_one_line_and_leaves_nothing(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["corpus"]["source"] = str(tmp_path / "nowhere")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = _cli(["stage", "corpus"], tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("astrai: error: ") and "nowhere" in last, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "data" / "corpus").exists()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_every_command_has_help(tmp_path):
    for cmd in ([], ["pipeline"], ["stage"], ["train"], ["generate"]):
        out = _cli(cmd + ["--help"], tmp_path)
        assert out.returncode == 0 and "Usage" in out.stdout, (cmd, out.stderr)


def test_every_param_dvc_yaml_lists_is_written_in_params_yaml():
    """DVC refuses a stage whose `params:` names a key missing from params.yaml (pydantic defaults don't count)."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "params.yaml").read_text())
    for name, stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].items():
        for key in stage.get("params", []):
            node = raw
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"dvc.yaml stage {name}: {key} not in params.yaml"
                node = node[part]


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_every_profile_merges_into_a_valid_params(profile):
    """profiles/*.yaml (quick, finetune, gpu) each give a valid run configuration over the real params.yaml (finetune
    with the model it starts from, which its command names; without one it says so)."""
    from astrai_core.runtime.errors import AstraiError
    from tasks.run.params import load_profile, parse_params, run_params_text

    sets = {"pretrain.init_from": "models:/some-model@champion"} if profile == "finetune" else {}
    text = run_params_text(ROOT / "params.yaml", sets, load_profile(ROOT, profile))
    params = parse_params(yaml.safe_load(text))
    assert params.model.vocab_size >= params.tokenizer.vocab_size
    if profile == "finetune":
        with pytest.raises(AstraiError, match="pretrain.enabled: false needs pretrain.init_from"):
            parse_params(yaml.safe_load(run_params_text(ROOT / "params.yaml", {}, load_profile(ROOT, profile))))


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_profile_args_give_dvc_the_profiles_params(profile, tmp_path):
    """Issue 43, item 15: `dvc exp run` had no way to use a profile. `astrai profile-args NAME` prints it as -S
    options; applied by DVC's own override code (what `dvc exp run -S` calls), params.yaml becomes exactly the
    params `astrai pipeline --profile NAME` runs with, its name included (issue 50, 5: an experiment of the quick
    profile registered a toy model as `astrai`), and --set on top (finetune needs its model)."""
    from dvc.utils.hydra import apply_overrides

    from tasks.run.params import load_profile, parse_params, run_params_text

    sets = {"pretrain.init_from": "models:/some-model@champion"} if profile == "finetune" else {}
    out = subprocess.run([sys.executable, "-m", "astrai.cli", "profile-args", profile,
                          *(f"--set={k}={v}" for k, v in sets.items())], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # as the shell splits $(astrai profile-args NAME)
    assert words[::2] == ["-S"] * (len(words) // 2) and len(words) % 2 == 0
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    apply_overrides(params, words[1::2])
    by_dvc = parse_params(yaml.safe_load(params.read_text()))
    changes = {**load_profile(ROOT, profile), "register": {"profile": profile}}
    by_profile = parse_params(yaml.safe_load(run_params_text(ROOT / "params.yaml", sets, changes)))
    assert by_dvc == by_profile and by_dvc.register.profile == profile


def test_profile_args_refuses_what_the_pipeline_refuses(tmp_path):
    """Issue 50 (18): `profile-args` printed an unknown key (-S +pretrain.nosuch=3, rc 0) that --profile refuses, left
    `*` for the shell to expand, and a non-UTF-8 profile was a bare UnicodeDecodeError."""
    from astrai_core.runtime.errors import AstraiError
    from tasks.run.params import profile_overrides

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "profiles").mkdir()
    for name, text, message in (
            ("unknown", "pretrain: {nosuch: 3}\n", "pretrain.nosuch: unknown key"),
            ("glob", "corpus: {source: 'texts/*.txt'}\n", "corpus.source: 'texts/*.txt' cannot be passed as one -S word"),
            ("latin1", "corpus: {source: 'caf\xe9'}\n", "not UTF-8 text")):
        (tmp_path / "profiles" / f"{name}.yaml").write_bytes(text.encode("latin-1"))
        with pytest.raises(AstraiError) as e:
            profile_overrides(tmp_path, name)
        assert f"profiles/{name}.yaml: {message}" in str(e.value) and "\n" not in str(e.value), str(e.value)
