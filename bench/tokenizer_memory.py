"""Peak memory of the tokenizer stage on one huge single-line document, and that its tokenizer is unchanged (issue 32,
item 13).

    python bench/tokenizer_memory.py                         # 20 MB; writes bench/tokenizer_memory_report.json
    python bench/tokenizer_memory.py --mb 5 --no-report
    git archive 2ce9d43 | tar -x -C /tmp/before && python bench/tokenizer_memory.py --before /tmp/before

Corpora (data/corpus/train.jsonl as the corpus stage writes it): `single_line`, the huge document (words separated by
single spaces, no newline) and a few small ones; `lines`, the same text with a newline about every 80 characters,
as one document; `demo`, the default corpus (the Shakespeare of params.yaml's corpus section, fetched by the
corpus stage). Each is trained on by the tokenizer stage itself (build_tokenizer with params.yaml's tokenizer
section) in a fresh Python process, which reports its own peak resident set size (getrusage ru_maxrss, the
tokenizer's threads included) and the sha256 of the tokenizer.json it wrote. --before DIR runs the same with the
code in DIR (another checkout): equal sha256s mean the same vocabulary and merges, byte for byte. --limit-gb caps
a run's address space (prlimit), so a blow-up fails instead of starving the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from memcap import commit, run_capped  # noqa: E402
from pack_memory import words  # noqa: E402 - the same words as the pack stage's benchmark

STAGE = r"""
import hashlib, json, resource, sys, time
from pathlib import Path
corpus, out = Path(sys.argv[1]), Path(sys.argv[2])
from tasks.run.params import load_params
from tasks.stages.tokenizer import build_tokenizer
params = load_params(sys.argv[3]).tokenizer
t = time.time()
path = build_tokenizer(params, corpus, out)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": round(time.time() - t, 2),
                  "tokenizer_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
"""


def write_corpus(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    return folder


def in_lines(text: str, width: int = 80) -> str:
    """`text` with each space after `width` or more characters of a line made a newline."""
    out, start = [], 0
    while start < len(text):
        cut = text.find(" ", start + width)
        cut = len(text) if cut < 0 else cut
        out.append(text[start:cut])
        start = cut + 1
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="size of the huge document in MB (ASCII: characters)")
    ap.add_argument("--limit-gb", type=float, default=8.0, help="address-space cap per run (0: none)")
    ap.add_argument("--before", type=Path, help="also run the stage with the code of this directory")
    ap.add_argument("--no-demo", action="store_true", help="skip the default corpus")
    ap.add_argument("--report", default=str(ROOT / "bench" / "tokenizer_memory_report.json"))
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from tasks.run.params import load_params
    from tasks.stages.corpus import build_corpus

    codes = {"this checkout": ROOT, **({"before": args.before} if args.before else {})}
    results: dict[str, dict] = {label: {} for label in codes}
    with tempfile.TemporaryDirectory(prefix="tokenizer_memory.") as tmp:
        root = Path(tmp)
        big, small = words(int(args.mb * 1e6), 0), [words(2000, i) for i in range(1, 7)]
        corpora = {"single_line": write_corpus(root / "single_line", [big, *small]),
                   "lines": write_corpus(root / "lines", [in_lines(big), *small])}
        if not args.no_demo:
            build_corpus(load_params(ROOT / "params.yaml").corpus, root / "demo")
            corpora["demo"] = root / "demo"
        for name, corpus in corpora.items():
            for label, code in codes.items():
                res = results[label][name] = run_capped(code, STAGE, [str(corpus), str(root / "out" / label / name),
                                                                      str(ROOT / "params.yaml")], args.limit_gb or None)
                print(label, name, json.dumps(res), flush=True)
    same = {name: len({results[label][name].get("tokenizer_sha256") for label in codes}) == 1 for name in corpora}
    report = {"document_mb": args.mb, "commit": commit(ROOT), "before": str(args.before),
              "machine": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "same_tokenizer_as_before": same if args.before else None, "results": results}
    print(json.dumps(report["same_tokenizer_as_before"]))
    if not args.no_report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
