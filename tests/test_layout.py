"""The package's import picture: storm's modules import each other without a loop."""

import ast
from pathlib import Path

import networkx as nx

import storm_compile
from storm_compile import passes

PACKAGES = {"storm_compile": Path(storm_compile.__file__).parent,
            "storm_compile.passes": Path(passes.__file__).parent}


def _module(package: str, path: Path) -> str:
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """storm modules a module imports (``from storm_compile import x`` names module ``x``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            named = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= named or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def test_no_import_loop():
    files = {_module(package, path): path for package, folder in PACKAGES.items()
             for path in folder.glob("*.py")}
    graph = nx.DiGraph()
    for module, path in files.items():
        graph.add_node(module)
        for imported in _imports(ast.parse(path.read_text()), set(files)):
            graph.add_edge(module, imported)
    assert graph.number_of_edges() > len(files), "the import picture was not read"
    assert list(nx.simple_cycles(graph)) == []


def test_the_readmes_quickstart_example_trains():
    """``python examples/quickstart.py``, as the README gives it: three steps, losses that
    fall."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                          timeout=600, check=True)
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_every_doc_the_readme_lists_exists():
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    listed = {line.split("`")[1] for line in readme.splitlines() if line.startswith("- `docs/")}
    assert listed == {f"docs/{p.name}" for p in (root / "docs").glob("*.md")}
