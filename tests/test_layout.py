"""The package's import picture: storm's modules import each other without a loop."""

import ast
from pathlib import Path

import networkx as nx
import pytest

import storm_compile
from storm_compile import passes
from storm_compile.config import PEAK_MARGIN

PACKAGES = {"storm_compile": Path(storm_compile.__file__).parent,
            "storm_compile.passes": Path(passes.__file__).parent}


def _modules() -> dict[str, Path]:
    """Every storm module, sub-packages' included, by its dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


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
    files = _modules()
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


def test_the_docs_state_the_byte_budgets_margin_storm_plans_with():
    """The README and docs/planning.md give a byte budget's margin as ``PEAK_MARGIN`` is."""
    root = Path(__file__).resolve().parent.parent
    margin = f"{PEAK_MARGIN:.0%}".replace("%", " %")
    assert f"planned {margin} below the cap" in (root / "README.md").read_text()
    assert f"byte budget's peak {margin} below it" in (root / "docs" / "planning.md").read_text()


def _private_torch(tree: ast.AST) -> list[str]:
    """A module's imports of private torch modules or names and its reads of private torch
    attributes (``torch._C.x``, ``torch.autograd.Variable._execution_engine``; ``torch.ops``
    paths name operators, not APIs)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "torch"
                      and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [n for n in names if any(p.startswith("_") for p in n.split("."))]
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            chain.reverse()
            if isinstance(value, ast.Name) and value.id == "torch" and chain[0] != "ops" \
                    and any(p.startswith("_") and not p.startswith("__") for p in chain):
                found.append(".".join(["torch", *chain]))
    return found


def test_private_torch_apis_live_in_one_module():
    """Only ``storm_compile.fx.torch_private`` touches torch's private APIs; the rest import them
    from it, so a torch release that moves one breaks one table, with a clear error."""
    sample = "import torch._C\nfrom torch.utils import _pytree\nx = torch._C.f(torch.ops.aten._to_copy)"
    assert set(_private_torch(ast.parse(sample))) == {"torch._C", "torch.utils._pytree",
                                                      "torch._C.f"}
    touched = {module: _private_torch(ast.parse(path.read_text()))
               for module, path in _modules().items() if path.name != "torch_private.py"}
    assert {name: apis for name, apis in touched.items() if apis} == {}


def test_every_private_torch_api_resolves_or_names_the_torch_it_missed(monkeypatch):
    """Each API of the table is found in this torch; one it lacks is a
    ``StormTorchVersionError`` naming the API, the torch version and the tested releases; an
    optional one reads as None."""
    from storm_compile.fx import torch_private

    import torch

    for name in torch_private.APIS:
        assert getattr(torch_private, name) is not None, name
    monkeypatch.setitem(torch_private.APIS, "moved", ("torch._nowhere:thing", "torch:_gone"))
    with pytest.raises(torch_private.StormTorchVersionError) as raised:
        torch_private.moved
    message = str(raised.value)
    assert "torch._nowhere:thing or torch:_gone" in message
    assert torch.__version__ in message and "2.11 and 2.13" in message
    monkeypatch.setitem(torch_private.OPTIONAL, "moved", ("torch._nowhere:thing",))
    assert torch_private.optional("moved") is None


def test_the_layout_tour_names_every_module():
    """``docs/layout.md`` names each module of the package under its sub-package's item (the
    package's own modules before the first), all but a sub-package's docstring-only
    ``__init__.py``."""
    import re

    root = Path(__file__).resolve().parent.parent
    tour = (root / "docs" / "layout.md").read_text()
    items = dict(re.findall(r"^  - `(\w+)/` — (.*?)(?=^  - `|^- )", tour, flags=re.M | re.S))
    items[""] = tour.split("\n  - `", 1)[0]
    folder = PACKAGES["storm_compile"]
    modules = [path for path in folder.rglob("*.py")
               if len(ast.parse(path.read_text()).body) > 1]
    missing = [str(path.relative_to(folder)) for path in modules
               if f"`{path.name}`" not in items.get(path.parent.relative_to(folder).as_posix()
                                                    .replace(".", ""), "")]
    assert missing == []


def test_the_build_lists_every_sub_package():
    """``pyproject.toml`` lists its packages by name: a sub-package left out would be missing
    from a built wheel while an editable install still found it."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folder = PACKAGES["storm_compile"]
    found = {".".join(("storm_compile", *init.parent.relative_to(folder).parts))
             for init in folder.rglob("__init__.py")}
    assert found | {"storm_compile.passes"} == listed
