"""The package's import contract, read from the source with `ast` (nothing is imported).

- No import circle between m3lm's modules, counting imports inside functions too.
- `m3lm/kernels/` imports only itself, `m3lm.core` and `m3lm.errors`: no model, layer or engine.
- No module of the package imports the package root (`import m3lm`, `from m3lm import NAME`):
  the root only re-exports, so a module imports a name from the module that defines it.
- No `sys.path` edit in the package.
- What the server process runs (`server/` with the engine's client, `text/`, `wire`, `core`)
  imports, at module level, nothing that runs the model: no model, layer, kernel, cache,
  scheduler, sampler, loader or engine-step module (those load in the engine process; a test over
  a live server checks the process itself, `test_serve_lifecycle.py`).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGE = Path(__file__).resolve().parents[1] / "m3lm"
KERNELS_MAY_IMPORT = ("kernels", "core", "errors")  # under the package
# The two processes, by folder or module (each name covers what lies under it): what the HTTP
# server runs, and what runs the model (loaded in the engine process only). Both sides import
# `wire` (the messages between them), `core` and `errors`.
SERVER_SIDE = ("server", "text", "wire", "core", "grammar", "tokenizer")
ENGINE_SIDE = (
    "models",
    "layers",
    "kernels",
    "cache",
    "loader",
    "weight_copy",
    "sampler",
    "engine",
    "distributed",
)


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def imports(tree: ast.AST, modules: dict[str, Path], pkg: str) -> list[tuple[str, int, bool]]:
    """(module imported, line, binds the package root) for every import of `pkg` in the tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == pkg:
                    out.append((alias.name, node.lineno, alias.asname is None))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != pkg:
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    out.append((sub, node.lineno, False))
                else:
                    out.append((node.module, node.lineno, node.module == pkg))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append(("<relative>", node.lineno, False))
    return out


def module_level(tree: ast.Module) -> ast.Module:
    """The imports a module runs when it is imported: its top-level statements (not those in
    functions, nor under `if`, where `TYPE_CHECKING` imports live)."""
    body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    body += [
        n
        for t in tree.body
        if isinstance(t, ast.Try)
        for n in t.body
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    return ast.Module(body=body, type_ignores=[])


def sys_path_edits(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def contract_violations(root: Path = PACKAGE) -> list[str]:
    pkg = root.name
    kernels_may_import = tuple(f"{pkg}.{m}" for m in KERNELS_MAY_IMPORT)
    server_side = tuple(f"{pkg}.{m}" for m in SERVER_SIDE)
    engine_side = tuple(f"{pkg}.{m}" for m in ENGINE_SIDE)
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    bad = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root.parent)
        graph[name] = set()
        for target, line, binds_root in imports(tree, modules, pkg):
            if target == "<relative>":
                bad.append(f"{where}:{line}: relative import (write the module's full name)")
                continue
            if binds_root and name != pkg:
                bad.append(f"{where}:{line}: imports the package root; import from the defining module")
            if name.startswith(f"{pkg}.kernels") and not target.startswith(kernels_may_import):
                bad.append(f"{where}:{line}: kernels/ imports {target} (only kernels, core, errors)")
            if target in modules and target != name:
                graph[name].add(target)
        if name.startswith(server_side):
            for target, line, _ in imports(module_level(tree), modules, pkg):
                if target.startswith(engine_side):
                    bad.append(f"{where}:{line}: the server side imports {target} (it runs the model)")
        bad += [f"{where}:{line}: sys.path edit" for line in sys_path_edits(tree)]
    bad += ["import circle: " + " <-> ".join(c) for c in cycles(graph)]
    return bad


def test_the_package_keeps_its_import_contract():
    assert contract_violations() == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"a.py": "import p.b\n", "b.py": "def f():\n    from p import a\n"}, "import circle: p.a <-> p.b"),
        (
            {"kernels/__init__.py": "", "kernels/k.py": "from p.models import m\n"},
            "kernels/ imports p.models",
        ),
        ({"a.py": "import p\n"}, "imports the package root"),
        ({"a.py": "from p import thing\n"}, "imports the package root"),
        ({"a.py": "import sys\nsys.path.insert(0, 'x')\n"}, "sys.path edit"),
        ({"a.py": "from . import b\n", "b.py": ""}, "relative import"),
        (
            {"server/__init__.py": "", "server/s.py": "from p.engine.engine import LLMEngine\n"},
            "the server side imports p.engine.engine",
        ),
    ],
)
def test_the_contract_check_finds_each_kind_of_breach(tmp_path, files, expected):
    """The checker itself, on a small package `p` that breaks one rule at a time."""
    pkg = tmp_path / "p"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    found = contract_violations(pkg)
    assert any(expected in line for line in found), found


def third_party_imports(root: Path = PACKAGE) -> set[str]:
    """Top-level names of everything the package imports from outside itself and the stdlib."""
    names = set()
    for path in module_files(root).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("__future__", root.name)}


def test_pyproject_lists_every_distribution_the_package_imports():
    """A plain `pip install m3lm` brings everything the package imports (Triton comes with
    torch's CUDA build, and only the GPU kernels import it; matplotlib, for plots, is the `plot`
    extra, Ray for `serve_ray.py` the `ray` extra)."""
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    listed = {canonicalize_name(Requirement(r).name) for r in pyproject["project"]["dependencies"]}
    # an extra's packages are imported on use, where the feature they serve runs (plots, Ray Serve)
    extras = pyproject["project"]["optional-dependencies"]
    listed |= {canonicalize_name(Requirement(r).name) for r in extras["plot"] + extras["ray"]}
    dists = metadata.packages_distributions()
    missing = {}
    for name in third_party_imports() - {"triton"}:
        found = {canonicalize_name(d) for d in dists.get(name, [name])}
        if not found & listed:
            missing[name] = sorted(found)
    assert missing == {}


def test_the_layout_stays_readable():
    """Functions, not files, are what a size cap should bound: lint refuses a package function of
    McCabe complexity over 10 (pyproject's `C90`) unless it says `noqa: C901`, which at most 12
    may. The README at most 200 lines; at most 12 benchmark scripts at the top of benchmarks/ (the
    rest in its folders)."""
    root = PACKAGE.parent
    lint = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "C90" in lint["select"] and lint["mccabe"]["max-complexity"] == 10
    waived = {
        f"{p.relative_to(root)}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "noqa: C901" in line
    }
    assert len(waived) <= 12, sorted(waived)
    assert len((root / "README.md").read_text().splitlines()) <= 200
    assert len(list((root / "benchmarks").glob("*.py"))) <= 12


def test_the_scheduler_and_the_page_allocator_hold_no_tensors():
    """`engine/scheduler.py` and `cache/block_manager.py` plan with ids and counts alone: neither
    imports torch itself (a sequence's sampling generator is `engine/sequence.py`'s)."""
    for rel in ("engine/scheduler.py", "cache/block_manager.py", "cache/events.py"):
        tree = ast.parse((PACKAGE / rel).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not names & {"torch", "numpy", "triton"}, rel
