"""The package's layering (``shared/LAYOUT.md``), read from the source with ``ast`` (nothing is imported): no import
climbs up, and the areas' import graph has no circle.

From the bottom: ``amp`` / ``nosync`` (leaf helpers) -> ``ops`` (kernels and references: know nothing of layers,
CP, models or training) -> ``config``, ``packing`` -> ``layers`` (no process groups, no model; ``layers.plan``
names the ``cp=`` type, ``ContextParallelGroup``) -> ``capture_safe`` (runs a layer step), ``cp`` -> ``models`` (no
trainer, no ``parallel``; ``models/deepseek_v4/flops.py`` counts a step's FLOPs for the planner, the trainer and
the report) -> ``parallel`` (wires the model; not the trainer, not the report) -> ``finetune`` (groups, LoRA,
adapters) -> ``train``, ``report``, ``integrations`` -> ``demo``, ``cli``. Nothing in
``csattn`` imports ``benchmarks``, ``lab`` or ``tests``, nor the package root (the public API re-exports; it is
not a dependency). Lazy imports inside functions count as imports.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "csattn"

# area -> the csattn areas it may import (its own always); an area missing here may import any area except those
# above it that name it in FORBIDDEN below.
ALLOWED: dict[str, set[str]] = {
    "amp": set(),
    "nosync": set(),
    "ops": {"amp", "nosync"},
    "config": {"ops"},
    "packing": {"ops", "nosync", "config"},
    "packing_capture_safe": {"ops", "nosync", "packing", "config"},
    # the capture-safe step runs a layer (it names the layer's ``cp=`` type, layers.plan.ContextParallelGroup)
    "capture_safe": {"amp", "nosync", "ops", "config", "packing", "packing_capture_safe", "layers"},
    "layers": {"amp", "nosync", "ops", "config", "packing", "packing_capture_safe"},
    "cp": {"amp", "nosync", "ops", "config", "packing", "packing_capture_safe", "capture_safe", "layers"},
}
FORBIDDEN: dict[str, set[str]] = {
    "models": {"train", "parallel", "finetune", "report", "integrations", "demo", "cli", "__main__"},
    "parallel": {"train", "finetune", "integrations", "report", "demo", "cli", "__main__"},
    # fine-tuning wires LoRA and freezing into the model (above models/, ops/ and parallel/), below the trainer
    "finetune": {"train", "integrations", "report", "demo", "cli", "__main__"},
    "integrations": {"train", "parallel", "report", "demo", "cli", "__main__"},
    "train": {"demo", "cli", "__main__", "integrations"},
    "report": {"demo", "cli", "__main__", "train"},
}
OUTSIDE = ("benchmarks", "lab", "tests")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in the file, relative ones resolved; ``from pkg import name``
    names the submodule where ``name`` is one."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else target))
    return found


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "csattn" and len(parts) > 1 else parts[0]


def _graph() -> dict[str, list[tuple[str, int, str]]]:
    """area -> ``(file, line, imported module)`` for every import of another area or of something outside."""
    edges: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _module(path)
        for line, target in _imports(path):
            if target.split(".")[0] not in ("csattn", *OUTSIDE):
                continue
            if target == "csattn" and src != "csattn":
                edges[_area(src)].append((str(path.relative_to(ROOT)), line, "csattn (the package root)"))
            elif _area(target) != _area(src) or target.split(".")[0] != "csattn":
                edges[_area(src)].append((str(path.relative_to(ROOT)), line, target))
    return edges


def test_no_import_climbs_up():
    bad = []
    for area, found in _graph().items():
        if area in ("csattn", "__main__"):
            continue
        for file, line, target in found:
            dest = _area(target) if target.startswith("csattn.") else target.split(" ")[0]
            if target.split(".")[0] in OUTSIDE:
                bad.append(f"{file}:{line} imports {target} (outside the package)")
            elif dest == "csattn":
                bad.append(f"{file}:{line} imports {target}")
            elif area in ALLOWED and dest not in ALLOWED[area]:
                bad.append(f"{file}:{line}: {area} imports {target}")
            elif dest in FORBIDDEN.get(area, ()):
                bad.append(f"{file}:{line}: {area} imports {target}")
    assert not bad, "imports that climb up (tests/test_layering.py has the rules):\n" + "\n".join(bad)


def test_areas_import_no_circle():
    graph = defaultdict(set)
    for area, found in _graph().items():
        if area in ("csattn", "__main__"):
            continue
        graph[area] |= {_area(t) for _, _, t in found if t.startswith("csattn.")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            raise AssertionError("the areas import in a circle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))


def test_the_rules_see_the_package():
    """The graph is not empty and knows every area the rules name (a renamed folder would silence a rule)."""
    areas = {_area(_module(p)) for p in PACKAGE.rglob("*.py")}
    named = set(ALLOWED) | set(FORBIDDEN) | {a for s in (*ALLOWED.values(), *FORBIDDEN.values()) for a in s}
    assert {"ops", "layers", "cp", "models", "train", "config", "packing"} <= areas
    assert named - {"parallel", "amp"} <= areas | {"__main__"}, sorted(named - areas)
    assert _graph()["layers"], "no imports found"
