"""bench/gpu.py, the GPU path's one-script benchmark (issue 44, item 6), checked on whatever device is here with
--smoke (tiny shapes, one round): every section runs and reports, the distributed and engine checks hold, and the
script imports nothing a lent GPU machine lacks (it has torch, transformers, numpy, h5py, safetensors, tokenizers,
jinja2 and carried pydantic wheels, and what they import; no Prefect, MLflow, DVC or the pipeline's packages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import PROJECT_ROOT

FORBIDDEN = {"prefect", "mlflow", "dvc", "fastapi", "uvicorn", "tasks", "flows", "serving", "astrai", "typer"}

RUN = """
import runpy, sys
sys.argv = ["bench/gpu.py", "--smoke", "--out", sys.argv[1]]
runpy.run_path("bench/gpu.py", run_name="__main__")
print("MODULES", " ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_gpu_bench_smoke_runs_every_section_with_the_allowed_imports(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", RUN, str(out)], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    modules = set(done.stdout.rsplit("MODULES ", 1)[1].split())
    assert not modules & FORBIDDEN, modules & FORBIDDEN
    assert {"torch", "transformers", "astrai_core", "pydantic"} <= modules

    report = json.loads(out.read_text())
    assert report["smoke"] and report["peak_flops"] > 0
    rows = report["training"]["tiny"]
    for variant in ("ours_eager", "ours_compiled", "hf_eager", "hf_compiled"):
        assert rows[variant]["tokens_per_sec"] > 0 and rows[variant]["mfu"] > 0, rows
    d = report["distributed"]
    assert d["run_to_run_bitwise_equal"] and d["resumed_bitwise_equal"], d
    assert d["resumed_from"] and d["stopped"] and "SIGTERM" in d["stopped"], d
    for streams, row in report["engine"]["tiny"].items():
        n = min(int(streams), 8)
        assert row["greedy_equal_to_generate"] == f"{n}/{n}" and row["tokens_per_sec"] > 0, row
