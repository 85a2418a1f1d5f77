"""The package's import graph is the layering docs/guide/layout.md draws: each unit (a
subpackage or a top-level module of ``src/zcvae``) imports only from units below it, so there are no
import cycles between units; and inside a unit no two modules import each other, however indirectly.
Every import counts, including the ones inside functions."""

import ast
from pathlib import Path

import zcvae

# From the bottom (docs/guide/layout.md). Units on one level do not import each other.
LAYERS = (
    ("strict", "_version", "presets", "console"),  # console: the logging setup every command shares  # presets: package data (YAML files) and the names that find them
    ("core", "distributed", "cpu"),  # cpu: the thread and memory policy of one process
    ("runs",),  # run names read the reconstruction-term registry (core/terms.py)
    ("data",),
    ("model",),
    ("engines", "reference", "loop"),  # engines: through model/hf_compat, the one home of HF/peft internals
    ("config",),  # below backbone: the entangled stage's PretrainConfig takes its shared fields from the sections
    ("backbone",),
    ("plan",),  # shapes without weights, the FLOP and memory models of `zcvae plan`
    ("export",),
    ("eval",),
    ("train",),
    ("sweep",),  # the family schema, SLURM rendering and the local runner, under the `zcvae sweep` CLI
    ("commands",),
    ("__init__", "__main__"),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}
ROOT = Path(zcvae.__file__).parent


def _unit(module: str) -> str:
    """zcvae.core.losses -> core; zcvae -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, modules: frozenset[str] = frozenset()) -> list[str]:
    """Every zcvae module `path` imports (``from zcvae import x`` names zcvae.x; ``from zcvae.p import m``
    names zcvae.p.m when that is one of ``modules``, else zcvae.p)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "zcvae":
            if node.module == "zcvae":
                out += [f"zcvae.{alias.name}" for alias in node.names]
            else:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules]
                out += submodules
                if len(submodules) < len(node.names):
                    out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names if alias.name.split(".")[0] == "zcvae"]
    return out


def _edges() -> list[tuple[str, str, str]]:
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        unit = parts[0] if len(parts) > 1 or parts[0] not in ("__init__",) else "__init__"
        for target in _imports(path):
            if _unit(target) != unit:
                edges.append((str(path.relative_to(ROOT)), unit, _unit(target)))
    return edges


def test_every_unit_has_a_level():
    units = {p.relative_to(ROOT).with_suffix("").parts[0] for p in ROOT.rglob("*.py")}
    assert units <= set(LEVEL), f"add {sorted(units - set(LEVEL))} to LAYERS and to docs/guide/layout.md"


def test_imports_only_go_down_the_layers():
    edges = _edges()
    assert edges, "no internal imports found: the scan is broken"
    upward = [f"{path} ({unit}) imports {target}" for path, unit, target in edges if LEVEL[target] >= LEVEL[unit]]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_scan_sees_function_level_and_package_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from zcvae import distributed as d\n\ndef f():\n    from zcvae.core.losses import x\n    import zcvae.runs.rundir\n")
    assert _imports(source) == ["zcvae.distributed", "zcvae.core.losses", "zcvae.runs.rundir"]


def _module_graph(root: Path) -> dict[str, set[str]]:
    """{module: the modules of the package at ``root`` it imports}; a package is its ``__init__``."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    modules = frozenset(paths)
    return {name: {t for t in _imports(path, modules) if t in modules and t != name} for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the modules of a strongly connected component (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycle_between_modules_of_one_package():
    graph = _module_graph(ROOT)
    assert graph["zcvae.commands.cli"], "no imports found in commands/cli.py: the scan is broken"
    cycles = _cycles(graph)
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_through_function_level_imports(tmp_path):
    """The cycle the sweep once had: cli imports sweep inside a function, sweep imports cli inside one."""
    package = tmp_path / "zcvae"
    (package / "commands").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "commands" / "__init__.py").write_text("")
    (package / "commands" / "cli.py").write_text("def main():\n    from zcvae.commands.sweep import local_main\n")
    (package / "commands" / "demo.py").write_text("from zcvae.commands import sweep\n")
    (package / "commands" / "sweep.py").write_text("def run():\n    from zcvae.commands.cli import build_parser\n")
    graph = _module_graph(package)
    assert graph["zcvae.commands.demo"] == {"zcvae.commands.sweep"}
    assert _cycles(graph) == [["zcvae.commands.cli", "zcvae.commands.sweep"]]
    (package / "commands" / "sweep.py").write_text("def run():\n    pass\n")
    assert _cycles(_module_graph(package)) == []
