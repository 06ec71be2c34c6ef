"""The package layering the design promises, read from the source (every import: top level, inside functions and
under TYPE_CHECKING): astrai (the command) -> flows -> tasks -> astrai_core and astrai -> serving -> astrai_core, astrai_core free of Prefect,
DVC and web code, serving free of Prefect and DVC, and no import circle. Inside tasks, its sub-packages are layered
the same way: stages -> registry -> run -> evaluation -> chat."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("astrai_core", "tasks", "serving", "flows", "astrai")
# What each package may import of the others. serving (the HTTP layer) sits beside tasks: both stand on astrai_core,
# neither knows the other; flows (the Prefect flows) chains tasks; astrai (the `astrai` command) uses them all.
MAY_IMPORT = {"astrai_core": set(), "tasks": {"astrai_core"}, "serving": {"astrai_core"},
              "flows": {"tasks", "astrai_core"}, "astrai": {"flows", "tasks", "serving", "astrai_core"}}
# tasks/ holds only these sub-packages, each of which may import those after it, never one before it: a stage uses
# the registry, the run's params, layout and tracking, the evaluation's metrics and the chat data; the registry
# (promote, model references, the champion gate) uses no stage; params read the metrics' names; the metrics name the
# demo's chat tasks.
TASKS_LAYERS = ("tasks.stages", "tasks.registry", "tasks.run", "tasks.evaluation", "tasks.chat")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, wherever the import statement sits."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_layers_point_down_only():
    against = [(a, b) for a, deps in graph().items() for b in deps
               if (pa := a.split(".")[0]) != (pb := b.split(".")[0]) and pb not in MAY_IMPORT[pa]]
    assert not against, f"imports against flows -> tasks/serving -> astrai_core: {against}"


def test_tasks_subpackages_point_down_only():
    subpackages = sorted(f"tasks.{p.parent.name}" for p in (ROOT / "tasks").glob("*/__init__.py"))
    assert subpackages == sorted(TASKS_LAYERS)
    assert [p.name for p in (ROOT / "tasks").glob("*.py")] == ["__init__.py"], "a module outside the sub-packages"
    layer = {name: i for i, name in enumerate(TASKS_LAYERS)}
    up = sorted((a, b) for a, deps in graph().items() for b in deps if a.startswith("tasks.") and b.startswith("tasks.")
                and layer[".".join(b.split(".")[:2])] < layer[".".join(a.split(".")[:2])])
    assert not up, f"imports against {' -> '.join(TASKS_LAYERS)}: {up}"


def test_tasks_subpackages_are_namespaces():
    """A sub-package's __init__ imports nothing: reading params (tasks.run.params) or a stage's module loads only
    what that module needs, not the stage table's MLflow or the others' torch."""
    found = sorted(module_name(p) for p in (ROOT / "tasks").rglob("__init__.py") if imports_of(p))
    assert not found, f"these __init__ modules import: {found}"


def banned_imports(package: str, banned: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((module_name(p), m) for p in (ROOT / package).rglob("*.py") for m in imports_of(p)
                  if m.split(".")[0] in banned)


def test_core_imports_no_orchestration_and_no_web_code():
    found = banned_imports("astrai_core", ("prefect", "dvc", "fastapi", "starlette", "uvicorn"))
    assert not found, f"astrai_core must not import Prefect, DVC or web code (that is serving/'s): {found}"


def test_serving_imports_no_orchestration():
    found = banned_imports("serving", ("prefect", "dvc"))
    assert not found, f"serving must not import Prefect or DVC: {found}"


def test_no_import_circle():
    packages = set(PACKAGES) | {"astrai_core.inference.engine"} | set(TASKS_LAYERS)  # a package's __init__ is a namespace
    deps = {a: bs - packages for a, bs in graph().items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(deps.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(deps):
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import circles: {cycles}"


def test_serving_uses_the_engine_through_its_interface_only():
    """serving/ is typed with EngineClient (what Engine and EngineProcess both implement), never with one of them;
    only serving/launch.py, which builds the engine `astrai serve` asked for, names them."""
    allowed = {"EngineClient", "SamplingParams", "TokenLogprob", "QueueFull"}
    layer = [p for p in (ROOT / "serving").rglob("*.py") if p != ROOT / "serving" / "launch.py"]
    found = sorted((module_name(p), m) for p in layer for m in imports_of(p)
                   if m.startswith("astrai_core.inference.engine") and m.rsplit(".", 1)[-1] not in allowed | {"engine"})
    assert not found, f"serving may import only {sorted(allowed)} from astrai_core.inference.engine: {found}"
