"""lm-evaluation-harness inside the evaluate stage: the project's tasks in evals/lm_eval_tasks/ run in process on
each model of the chain through an lm-eval `LM` over the project's model (no HTTP server), scored by
astrai_core.scoring.metrics (loglikelihood requests, batched) and astrai_core.inference.generate (generate_until, greedy,
batched).

It scores exactly what lm-eval's `local-completions` gets from `astrai serve` (tests/test_lm_eval.py checks them
number for number): the same tokens (lm-eval's TemplateLM splits a context and its continuation), the same left
truncation to the model's context, the same rolling windows for perplexity after the end-of-text token (the prefix
token lm-eval's remote tokenizer picks: the document boundary the model was trained with).

Local files only: the task definitions are read from evals/lm_eval_tasks/ and their data from the JSONL that
tasks/evaluation/lm_eval_data.py writes from the held-out plays; HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before
lm-eval loads them, so nothing is fetched.

    metric                               per item                  in evaluate's metrics.json
    <task>_acc, <task>_acc_norm,         1 right / 0 wrong         value, 95% Wilson interval; items.json; the paired
    <task>_exact_match                                             checks ("keep" against the starting model)
    <task>_bits_per_byte, ...            (not a proportion)        the value lm-eval aggregates
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
import yaml
from tokenizers import Tokenizer

from astrai_core.inference.generate import generate_batch
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file
from astrai_core.scoring.metrics import target_logprobs
from astrai_core.scoring.statistics import wilson_interval
from astrai_core.tokenizer.chat import ChatFormat
from tasks.evaluation.lm_eval_data import FILES, write_lm_eval_data

TASKS_DIR = Path(__file__).resolve().parents[2] / "evals" / "lm_eval_tasks"
REPORTED = ("acc", "acc_norm", "exact_match", "bits_per_byte", "byte_perplexity", "word_perplexity")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is imported: local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval.api.model import TemplateLM  # noqa: E402 - after the offline switches
from lm_eval import utils as lm_utils  # noqa: E402


class AstraiLM(TemplateLM):
    """An lm-eval model over a loaded astrai Transformer and its tokenizer; batch_size requests per forward."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat, batch_size: int = 16,
                 max_gen_toks: int = 64) -> None:
        super().__init__()
        self.model, self.tokenizer, self.batch_size, self.max_gen_toks = model, chat.tokenizer, batch_size, max_gen_toks
        self.max_length = model.cfg.max_seq_len
        self._eos = chat.special.eos
        self._chat = chat

    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def prefix_token_id(self) -> int:
        return self._eos

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) per (key, context ids, continuation ids), in request order;
        a sequence longer than the context keeps its last max_length tokens (as local-completions sends it)."""
        rows, targets = [], []
        for _, context, continuation in requests:
            rows.append((context + continuation)[-self.max_length:])
            targets.append(len(continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths share a batch
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for first in range(0, len(order), self.batch_size):
            chunk = order[first:first + self.batch_size]
            for i, res in zip(chunk, target_logprobs(self.model, [rows[i] for i in chunk], [targets[i] for i in chunk])):
                out[i] = res
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood in disjoint windows, each conditioned on the prefix token or the token
        before it (lm-eval's rolling windows, sized as local-completions sizes them)."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)):
                windows.append((None, *window))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, stopped where `astrai serve` stops a completion that lm-eval's local-completions
        sends with these `until` strings as `stop`: at end-of-text and at each special token an `until` string
        spells (the tasks' "<|end_of_turn|>"), and cut at the first of the other `until` strings."""
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kwargs = dict(req.args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            groups.setdefault((tuple(until), int(kwargs.get("max_gen_toks", self.max_gen_toks))), []).append(i)
        for (until, max_new), members in groups.items():
            max_new = min(max_new, self.max_length - 1)
            stop_ids = tuple(dict.fromkeys(self._chat.stop_ids + self._chat.special_ids(until)))  # as served:
            # ServedModel.completion_stop_ids
            prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] or [self._eos]
                       for i in members]
            for first in range(0, len(members), self.batch_size):
                chunk = members[first:first + self.batch_size]
                new = generate_batch(self.model, prompts[first:first + self.batch_size], max_new,
                                     stop_ids=stop_ids)
                for i, ids in zip(chunk, new):
                    text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] in stop_ids else ids)
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def task_configs(names: Sequence[str], data_dir: Path) -> list[dict]:
    """The task definitions of evals/lm_eval_tasks/ named, each reading its JSONL from data_dir
    (tasks/evaluation/lm_eval_data.py's FILES) instead of the path relative to the project's root the YAML names."""
    configs = []
    for name in names:
        config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
        split = config["test_split"]
        config["dataset_kwargs"] = {**config.get("dataset_kwargs", {}),
                                    "data_files": {split: str(Path(data_dir) / FILES[name])},
                                    "cache_dir": str(Path(data_dir) / "hf-datasets")}
        configs.append(config)
    return configs


def run_tasks(model: torch.nn.Module, chat: ChatFormat, names: Sequence[str], data_dir: Path,
              batch_size: int = 16) -> dict:
    """lm-eval's simple_evaluate of the named tasks on the model, in process -> its results (with the samples)."""
    from lm_eval import simple_evaluate
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    tasks = [ConfigurableTask(config=c) for c in task_configs(names, data_dir)]
    # A task manager without lm-eval's own task index: building that reads its ~14,000 YAML files (30 s).
    return simple_evaluate(model=AstraiLM(model, chat, batch_size), tasks=tasks, log_samples=True,
                           bootstrap_iters=0, task_manager=TaskManager(include_defaults=False))


def scores(results: dict) -> tuple[dict[str, float], dict[str, list[int]]]:
    """lm-eval's results -> (metrics: <task>_<metric>, with _low/_high and n/ for the per-item proportions; the
    per-item results of those: 1 right, 0 wrong, in document order)."""
    metrics: dict[str, float] = {}
    items: dict[str, list[int]] = {}
    for task, values in results["results"].items():
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        for key, value in values.items():
            metric, _, _filter = key.partition(",")
            if metric not in REPORTED or not isinstance(value, (int, float)):
                continue
            name = f"{task}_{metric}"
            per_item = [s[metric] for s in samples]
            if all(v in (0, 1, True, False) for v in per_item):
                right = [int(v) for v in per_item]
                low, high = wilson_interval(sum(right), len(right))
                metrics |= {name: sum(right) / len(right), f"{name}_low": low, f"{name}_high": high}
                items[name] = right
            else:
                metrics[name] = float(value)
    return metrics, items


def write_items(corpus_dir: Path, out_dir: Path, names: Sequence[str], limit: int, seed: int) -> Path | None:
    """The named tasks' items from the held-out plays in corpus_dir (as `astrai lm-eval-data` writes them), `limit`
    per task, into out_dir -> out_dir; None, with a WARNING, when the test split has none for one of them (a corpus
    that is not plays)."""
    try:
        write_lm_eval_data(corpus_dir, out_dir, limit, seed, names)
    except AstraiError as e:
        print(f"WARNING: evaluate: no lm-eval tasks run: {e}", flush=True)
        return None
    return out_dir


def item_sets(names: Sequence[str], data_dir: Path, items: Sequence[str]) -> dict[str, str]:
    """metric -> sha256 of the task file its items came from (as held_out.item_sets), for the metrics scored per
    item."""
    return {metric: sha256_file(Path(data_dir) / FILES[task]) for task in names for metric in items
            if metric.startswith(f"{task}_")}
