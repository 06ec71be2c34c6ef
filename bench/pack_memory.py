"""Peak memory of the corpus and pack stages on one huge single-line document (issue 14, item 10).

    python bench/pack_memory.py                    # a 50 MB document as .txt and as .jsonl; writes bench/pack_memory_report.json
    python bench/pack_memory.py --mb 20 --no-report
    git archive f09342a | tar -x -C /tmp/before && python bench/pack_memory.py --before /tmp/before   # and older code

Each source holds the huge document (words separated by single spaces, no newline) and a few small documents, so
every split has one. The tokenizer is trained once on small text of the same words (training it on the huge
document is not what is measured). Each stage then runs in a fresh Python process (the stage function itself,
as `astrai stage` calls it), which reports its own peak resident set size (getrusage ru_maxrss, the tokenizer's
threads included). --before DIR runs the stages a second time with the code in DIR (another checkout) on the same
files. --limit-gb caps a stage's address space (prlimit), so a blow-up fails instead of starving
the machine; a capped run is reported as failed, with the cap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from memcap import commit, run_capped  # noqa: E402

WORDS = ("the king queen lord my thy thee sweet love death night day hath doth what shall come go speak tell "
         "heaven earth heart blood crown sword honour fair good noble, villain! O? me; you. and to of in that is").split()

STAGE = r"""
import json, resource, sys, time
from pathlib import Path
stage, src, work, pack_params = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
t = time.time()
if stage == "corpus":
    from tasks.run.schema import CorpusParams
    from tasks.stages.corpus import build_corpus
    build_corpus(CorpusParams(source=src), work / "corpus")
else:
    from tasks.run.schema import PackParams
    from tasks.stages.pack import pack
    pack(PackParams(**pack_params), work / "corpus", work / "tokenizer.json", work / "packed")
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.time() - t}))
"""


def words(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def make_sources(root: Path, mb: float) -> dict[str, Path]:
    big = words(int(mb * 1e6), 0)
    small = [words(2000, i) for i in range(1, 7)]
    txt = root / "src_txt"
    txt.mkdir()
    (txt / "big.txt").write_text(big)
    for i, s in enumerate(small):
        (txt / f"small{i}.txt").write_text(s + "\n")
    jsonl = root / "src_jsonl"
    jsonl.mkdir()
    with open(jsonl / "docs.jsonl", "w") as f:
        for s in [big, *small]:
            f.write(json.dumps({"text": s}) + "\n")
    return {"txt": txt, "jsonl": jsonl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="size of the huge document in MB (ASCII: characters)")
    ap.add_argument("--limit-gb", type=float, default=14.0, help="address-space cap per stage (0: none)")
    ap.add_argument("--pack", action="append", default=[], metavar="KEY=VALUE",
                    help="a pack param, e.g. --pack batch_characters=100000 (default: those of tasks/run/schema.py)")
    ap.add_argument("--before", type=Path, help="also run the stages with the code of this directory")
    ap.add_argument("--report", default=str(ROOT / "bench" / "pack_memory_report.json"))
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from astrai_core.tokenizer.bpe import train_tokenizer

    pack_params = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.pack)}
    codes = {"this checkout": ROOT, **({f"before ({args.before})": args.before} if args.before else {})}
    results = {label: {} for label in codes}
    with tempfile.TemporaryDirectory(prefix="pack_memory.") as tmp:
        root = Path(tmp)
        sources = make_sources(root, args.mb)
        tok = train_tokenizer([words(200_000, 99)], vocab_size=512)
        for label, code in codes.items():
            for kind, src in sources.items():
                work = root / f"work_{kind}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                tok.save(str(work / "tokenizer.json"))
                res = results[label][kind] = {
                    stage: run_capped(code, STAGE, [stage, str(src), str(work), json.dumps(pack_params)],
                                      args.limit_gb or None) for stage in ("corpus", "pack")}
                if "failed" not in res["pack"]:
                    res["packed_stats"] = json.loads((work / "packed" / "stats.json").read_text())
                print(label, kind, json.dumps(res))
    report = {"document_mb": args.mb, "pack_params": pack_params, "commit": commit(ROOT), "machine": platform.node(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    if not args.no_report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
