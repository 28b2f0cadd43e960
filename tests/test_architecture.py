"""The package's shape, read from its source (ast): packages import only those below them (or
a peer of their layer named in PEERS), no module imports itself back through others
(TYPE_CHECKING imports count), and no module reads the private members of another file's
objects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vinterp

ROOT = Path(vinterp.__file__).parent
# Lower layers first; a module may import its own package and the packages of lower layers.
LAYERS = [
    {"errors"},
    {"models", "sites", "store"},
    {"ir"},
    {"wire"},
    {"sae"},
    {"interventions"},
    {"runtime"},
    {"engine"},
    {"api", "extraction"},
    {"__init__"},  # the `vinterp` namespace users import
    {"serve", "bench", "plot", "demo"},
    {"cli"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
# Parts of one layer that may import each other: extraction runs prompts through the api's
# LLMs (and its capture reading), and `LLM.extract` runs an extraction. Module cycles are
# still refused (test_no_import_cycles).
PEERS = {frozenset({"api", "extraction"})}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in SOURCES.items()}


def imported(name: str) -> set[str]:
    """The vinterp modules `name` imports, anywhere in the file."""
    package = name if SOURCES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "vinterp"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "vinterp":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in SOURCES else base)
    return out - {name}


IMPORTS = {name: imported(name) for name in SOURCES}


def part(name: str) -> str:
    """The layer part a module belongs to: its top package, or its own name at the root."""
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_module_has_a_layer() -> None:
    assert {part(name) for name in SOURCES} <= set(RANK)


def test_packages_import_only_lower_layers() -> None:
    upward = [
        f"{name} -> {target}"
        for name, targets in IMPORTS.items()
        for target in targets
        if part(target) != part(name)
        and RANK[part(target)] >= RANK[part(name)]
        and frozenset({part(target), part(name)}) not in PEERS
    ]
    assert upward == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert cycles(IMPORTS) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_names(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, module names, attributes it sets on
    `self`, class attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    names.add(target.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


DEFINED = {name: private_names(tree) for name, tree in TREES.items()}
DEFINED_ANYWHERE = set().union(*DEFINED.values())


def foreign_private_reads(name: str) -> list[str]:
    """`obj._x` (obj not self/cls) or `from vinterp... import _x`, where `_x` is defined by
    another vinterp file only."""
    own = DEFINED[name]
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if attr in DEFINED_ANYWHERE and attr not in own:
                found.append(f"{name}:{node.lineno} .{attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vinterp"):
            found += [
                f"{name}:{node.lineno} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_no_private_reads_across_files(name: str) -> None:
    assert foreign_private_reads(name) == []


def test_private_read_checker_sees_a_read() -> None:
    TREES["probe"] = ast.parse("def f(llm):\n    return llm._engine.run()\n")
    DEFINED["probe"] = set()
    global DEFINED_ANYWHERE
    saved = DEFINED_ANYWHERE
    DEFINED_ANYWHERE = saved | {"_engine"}
    try:
        assert foreign_private_reads("probe") == ["probe:2 ._engine"]
    finally:
        DEFINED_ANYWHERE = saved
        del TREES["probe"], DEFINED["probe"]


def imports_vllm(name: str) -> list[int]:
    """Lines of module `name` that import vLLM (anywhere in the file)."""
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [node.lineno for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found.append(node.lineno)
    return found


def test_only_engine_imports_vllm_and_only_the_boundary_reaches_its_internals() -> None:
    """engine/ is the vLLM adapter; inside it, vllm_boundary/ holds every hook and internal
    read, and the other engine modules use vLLM's public API (`vllm.LLM`, `SamplingParams`,
    its engine arguments and server)."""
    outside = [f"{n}:{line}" for n in SOURCES if part(n) != "engine" for line in imports_vllm(n)]
    assert outside == []
    public = (  # the engines, the platform, and `vllm serve`'s entry and argument parser
        "vllm.engine.arg_utils",
        "vllm.v1.engine.async_llm",
        "vllm.platforms",
        "vllm.entrypoints.",
        "vllm.logger",
        "vllm.utils.argparse_utils",
    )
    internal = []
    for name in SOURCES:
        if part(name) != "engine" or name.startswith("vinterp.engine.vllm_boundary"):
            continue
        for node in ast.walk(TREES[name]):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [module]
            for m in modules:
                if m and m.split(".")[0] == "vllm" and m != "vllm" and not m.startswith(public):
                    internal.append(f"{name}:{node.lineno} {m}")
    assert internal == []


# Attributes of vLLM's engines, configurations and workers: read only in engine/vllm_boundary/
VLLM_INTERNALS = {
    "llm_engine",
    "engine_core",
    "vllm_config",
    "model_config",
    "scheduler_config",
    "cache_config",
    "parallel_config",
    "compilation_config",
    "additional_config",
    "model_runner",
}


def internal_reads(name: str) -> list[str]:
    """`module:line .attribute` for each read of a vLLM internal attribute in module `name`."""
    return [
        f"{name}:{node.lineno} .{node.attr}"
        for node in ast.walk(TREES[name])
        if isinstance(node, ast.Attribute) and node.attr in VLLM_INTERNALS
    ]


def test_only_the_boundary_reads_vllms_engine_config_and_workers() -> None:
    """What the import test cannot see: an attribute chain into a vLLM object passed in
    (`llm.llm_engine.engine_core`, `runner.vllm_config`) goes through vllm_boundary/."""
    found = [
        read
        for name in SOURCES
        if not name.startswith("vinterp.engine.vllm_boundary")
        for read in internal_reads(name)
    ]
    assert found == []


def test_internal_read_finder_sees_a_read() -> None:
    TREES["probe"] = ast.parse("def f(llm):\n    return llm.llm_engine.vllm_config\n")
    try:
        assert internal_reads("probe") == ["probe:2 .vllm_config", "probe:2 .llm_engine"]
    finally:
        del TREES["probe"]


def test_vllm_import_finder_sees_an_import() -> None:
    TREES["probe"] = ast.parse("def f():\n    from vllm.distributed import get_pp_group\n")
    try:
        assert imports_vllm("probe") == [2]
    finally:
        del TREES["probe"]


def test_no_module_named_by_speed() -> None:
    assert [name for name in SOURCES if "fast" in name.split(".")[-1]] == []


def test_layers_are_documented_in_design() -> None:
    """docs/DESIGN.md's package table names every package, lower layers first."""
    design = (ROOT.parents[1] / "docs" / "DESIGN.md").read_text()
    tokens = design[design.index("vinterp/\n") :].split("```")[0].split()
    packages = [p for parts in LAYERS for p in sorted(parts) if (ROOT / p).is_dir()]
    assert [p for p in packages if f"{p}/" not in tokens] == []
    listed = sorted(packages, key=lambda p: tokens.index(f"{p}/"))
    assert [RANK[p] for p in listed] == sorted(RANK[p] for p in listed)


def test_each_class_is_defined_once() -> None:
    """One class per concept: no two modules define a class of the same name."""
    where: dict[str, list[str]] = {}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    assert {c: m for c, m in where.items() if len(m) > 1} == {}
