"""rnnlab's modules import one another without a circle: every import counted, at the top, inside a function
(lazy) or under TYPE_CHECKING, read from the source (ast), so a circle hidden by a lazy import fails too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: the rnnlab modules it imports}; `from a.b import c` counts a.b.c where that is a module, else a.b."""
    paths = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_rnnlab_modules():
    graph = import_graph(ROOT / "rnnlab")
    assert len(graph) > 30 and "rnnlab.cells.registry" in graph["rnnlab.cells.mamba"]
    assert circles(graph) == []


def test_the_check_finds_a_lazy_circle(tmp_path):
    """A planted circle closed only by an import inside a function is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a  # lazy\n    return a\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_the_run_imports_tensorboardx_without_torch_or_boto3():
    """train.py's imports leave torch and boto3 out (tensorboardX's writer would import them where installed: torch
    by the bench or refs extra, most of a run's start-up), and each still imports afterwards where installed."""
    import subprocess
    import sys

    code = ("import importlib.util, sys\n"
            "import rnnlab.board, rnnlab.metrics, rnnlab.trainer\n"
            "from tensorboardX import SummaryWriter\n"
            "assert 'torch' not in sys.modules and 'boto3' not in sys.modules, 'torch or boto3 imported'\n"
            "if importlib.util.find_spec('torch'):\n"
            "    import torch\n"
            "    assert torch.zeros(2).sum().item() == 0\n"
            "if importlib.util.find_spec('boto3'):\n"
            "    import boto3\n"
            "    assert boto3.session\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_one_orchestration_with_only_entry_points_on_top_of_it():
    """A run alone and a population are set up by one orchestration (rnnlab.trainer): only the population launcher
    imports it, and the member axis (rnnlab.population) neither runs the loop nor takes run dirs itself."""
    graph = import_graph(ROOT / "rnnlab")
    assert {m for m, deps in graph.items() if "rnnlab.trainer" in deps} == {"rnnlab.population_launch"}
    assert graph["rnnlab.population"].isdisjoint({"rnnlab.loop", "rnnlab.rundir", "rnnlab.trainer"}), \
        graph["rnnlab.population"]
