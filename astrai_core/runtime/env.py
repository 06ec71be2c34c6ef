"""The environment every entry point sets before Prefect, MLflow or DVC is imported: `apply()`, first thing, in the
`astrai` command (astrai/cli.py), the pipeline flow's module (flows/pipeline.py, which a Prefect worker imports) and
the training ranks (astrai_core/training/train.py main). The values are written once, in
astrai_core/runtime/env.defaults, which the Makefile includes too; they live here, in the core, because the ranks run
the core alone."""

import os
import re
from pathlib import Path

DEFAULTS_FILE = Path(__file__).with_name("env.defaults")
_LINE = re.compile(r"export ([A-Z][A-Z0-9_]*) \?= (\S+)")


def read_defaults(path: Path = DEFAULTS_FILE) -> dict[str, str]:
    """The `export KEY ?= VALUE` lines of `path` as {KEY: VALUE}; blank lines and # comments are skipped."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            if not (m := _LINE.fullmatch(line.strip())):
                raise ValueError(f"{path}:{n}: not `export KEY ?= VALUE` (a value without spaces): {line.strip()!r}")
            out[m[1]] = m[2]
    return out


DEFAULTS = read_defaults()


def apply() -> None:
    """Set each default the environment does not set already; make the directory PREFECT_HOME is in if it is missing
    (Prefect makes PREFECT_HOME itself, when it first needs it, but not its parents: its temporary server then fails
    to open its database, and the run waits 120 s for it and stops with "Timed out while attempting to connect")."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.environ.get("PREFECT_HOME"):
        try:
            Path(os.environ["PREFECT_HOME"]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # Prefect says what it could not make
            pass
