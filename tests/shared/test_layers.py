"""The layers the layout promises (README, "Layout"; docs/STYLE: the modules directly in
``shared/`` are the pure core, its subpackages adapters of one kind each):

- every module directly in ``shared/`` loads no boto3, obstore, confluent_kafka or pyspark, not even
  through what it imports;
- no production module loads the development stack (``shared/devstack/``);
- no module imports its importer: the project's modules have no import cycle, counting the
  imports inside functions;
- no module is over about 800 lines, except the vectorised Avro codec.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PACKAGES = ("shared", "services", "shardsink")
ADAPTER_LIBRARIES = ("boto3", "botocore", "obstore", "confluent_kafka", "pyspark", "py4j")
#: Entry points for development only: they start the embedded stack on purpose.
DEVELOPMENT_ENTRY_POINTS = {"services.demo", "shardsink.cli.stack"}
MAX_LINES = 800
#: The vectorised Avro codec: one decoder and one encoder per Avro type, kept together.
LONGER_ALLOWED = {"shared/avro_columns.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def loaded_by(modules: list[str]) -> set[str]:
    """The top-level names of what importing ``modules`` loads, in a fresh interpreter."""
    probe = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


CORE = sorted(m for m, p in project_modules().items() if p.parent == ROOT / "shared" and m != "shared")


@pytest.mark.parametrize("module", CORE)
def test_a_core_module_loads_no_adapter_library(module: str) -> None:
    loaded = loaded_by([module])
    assert {m for m in loaded if m.split(".")[0] in ADAPTER_LIBRARIES} == set(), module


def test_the_core_list_is_the_modules_directly_in_shared() -> None:
    assert "shared.shard" in CORE and "shared.frontier" in CORE
    assert not any(m.startswith(("shared.io", "shared.spark", "shared.devstack")) for m in CORE)


def test_no_production_module_loads_the_development_stack() -> None:
    production = sorted(
        m
        for m in project_modules()
        if not m.startswith("shared.devstack")
        and m not in DEVELOPMENT_ENTRY_POINTS
        and not m.endswith("__main__")
    )
    loaded = loaded_by(production)
    assert "shared.devstack" not in loaded and not any(m.startswith("shared.devstack.") for m in loaded)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, anywhere in its body (a function's imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            r = resolve(t)
            # A package's own submodules and the packages above a module are not cycles.
            if r is not None and r != name and not name.startswith(r + ".") and not r.startswith(name + "."):
                found.add(r)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_its_importer() -> None:
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == []


def test_no_module_is_over_about_800_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in project_modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES and str(p.relative_to(ROOT)) not in LONGER_ALLOWED
    }
    assert long == {}


def test_the_public_package_takes_from_the_services_only_their_settings() -> None:
    """``shardsink`` (the API and the CLI) imports the core, its adapters and the services'
    settings module, which itself imports no other part of the services."""
    modules = project_modules()
    public = {n: imports_of(n, p, modules) for n, p in modules.items() if n.startswith("shardsink")}
    from_services = {n: sorted(d for d in deps if d.startswith("services")) for n, deps in public.items()}
    assert {d for deps in from_services.values() for d in deps} <= {"services.runtime.settings"}, from_services
    settings = imports_of("services.runtime.settings", modules["services.runtime.settings"], modules)
    assert all(d.startswith("shared") for d in settings), settings
