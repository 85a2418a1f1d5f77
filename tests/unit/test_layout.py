"""The package's import graph is the layering the README's Layout section draws: each unit (a
subpackage or a top-level module of ``src/zcvae``) imports only from units below it, so there are no
import cycles. Every import counts, including the ones inside functions."""

import ast
from pathlib import Path

import zcvae

# From the bottom (README, Layout). Units on one level do not import each other.
LAYERS = (
    ("strict", "_version"),
    ("core", "distributed", "templates"),
    ("runs",),  # run names read the reconstruction-term registry (core/terms.py)
    ("data",),
    ("model", "engines", "reference", "loop"),
    ("backbone",),
    ("config",),
    ("export",),
    ("eval",),
    ("train",),
    ("commands",),
    ("__init__", "__main__"),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}
ROOT = Path(zcvae.__file__).parent


def _unit(module: str) -> str:
    """zcvae.core.losses -> core; zcvae -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[str]:
    """Every zcvae module `path` imports (``from zcvae import x`` names zcvae.x)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "zcvae":
            if node.module == "zcvae":
                out += [f"zcvae.{alias.name}" for alias in node.names]
            else:
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
    assert units <= set(LEVEL), f"add {sorted(units - set(LEVEL))} to LAYERS and to the README's Layout"


def test_imports_only_go_down_the_layers():
    edges = _edges()
    assert edges, "no internal imports found: the scan is broken"
    upward = [f"{path} ({unit}) imports {target}" for path, unit, target in edges if LEVEL[target] >= LEVEL[unit]]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_scan_sees_function_level_and_package_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from zcvae import distributed as d\n\ndef f():\n    from zcvae.core.losses import x\n    import zcvae.runs.rundir\n")
    assert _imports(source) == ["zcvae.distributed", "zcvae.core.losses", "zcvae.runs.rundir"]
