"""Every file the docs, the README and the code's docstrings and comments name exists (issue 45): a reader who
follows `tasks/stages/evaluate.py` or `docs/serving.md` finds it. Generated outputs (data/, reports, lm-eval data) and
placeholders (profiles/NAME.yaml) are not checked, nor a file at a git revision (`REV:path`, what a bench reads
from an older commit); DESIGN.md is the team's shared page, outside the project, and is not cited as if it were in
it."""

from __future__ import annotations

import re

from conftest import PROJECT_ROOT

TEXTS = ["*.md", "docs/*.md", "Makefile", "dvc.yaml", "params.yaml", "profiles/*.yaml", ".ci/run",
         *(f"{d}/**/*.py" for d in ("astrai", "astrai_core", "tasks", "flows", "serving", "bench", "tests", "scripts"))]
# A path into the project's source: a folder of it, then a file of a kind that is written by hand, not generated.
SOURCE = re.compile(r"(?<![\w./:-])((?:astrai|astrai_core|tasks|flows|serving|bench|tests|docs|scripts|profiles|evals)"
                    r"/[\w./-]*\w\.(?:py|md|yaml|sh|toml))\b")


def test_every_named_source_file_exists():
    missing = []
    for pattern in TEXTS:
        for file in PROJECT_ROOT.glob(pattern):
            text = file.read_text(errors="ignore")
            for m in SOURCE.finditer(text):
                path = m.group(1)
                if not re.search(r"/[A-Z]+\.yaml$", path) and not (PROJECT_ROOT / path).exists():
                    missing.append(f"{file.relative_to(PROJECT_ROOT)}: {path}")
            if re.search(r"(?<![/\w])DESIGN\.md", text) and file.name != "test_docs_paths.py":
                missing.append(f"{file.relative_to(PROJECT_ROOT)}: DESIGN.md (not in the project)")
    assert not missing, "\n".join(sorted(set(missing)))
