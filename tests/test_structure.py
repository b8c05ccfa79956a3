"""The package's structure, read from the source with `ast` (module-level and function-level imports
alike, so a ring cannot hide behind an import inside a function):

- passes/ (the IR-neutral core) imports neither onnx nor torch;
- no module imports a `_private` name from another lnfold module (a name another module needs is
  public; a third-party library's private names are reached in one module, THIRD_PARTY_PRIVATE);
- the import graph inside each package has no cycle: dependencies go one way.

    python -m pytest tests/test_structure.py -q

Each check is also run on a planted violation, so that it is seen to fail.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the folders that install as lnfold.<name> (pyproject.toml's package-dir)
PACKAGES = {"lnfold": "lnfold", "passes": "lnfold.passes", "fx_rewrite": "lnfold.fx_rewrite",
            "onnx_rewrite": "lnfold.onnx_rewrite", "zoo": "lnfold.zoo", "demo": "lnfold.demo"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    """lnfold module name -> its source."""
    return {_module_name(p): p.read_text() for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def imports(module: str, source: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in `source`, at any depth."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def _resolve(target: str, names: list[str], known: set[str]) -> list[str]:
    """The lnfold modules an import reads: `from pkg import mod` reads pkg.mod where that is one."""
    mods = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
    return mods if mods and len(mods) == len(names) else ([target] if target in known else []) + mods


def graph(srcs: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    known = set(srcs)
    g: dict[str, set[str]] = {}
    for mod, src in srcs.items():
        for target, names in imports(mod, src, mod in packages):
            g.setdefault(mod, set()).update(m for m in _resolve(target, names, known) if m != mod)
    return g


def core_imports_of_frameworks(srcs: dict[str, str], packages: set[str]) -> list[str]:
    bad = []
    for mod, src in srcs.items():
        if mod == "lnfold.passes" or mod.startswith("lnfold.passes."):
            for target, _ in imports(mod, src, mod in packages):
                if target.split(".")[0] in ("torch", "onnx", "onnxruntime", "onnx_graphsurgeon", "onnxscript"):
                    bad.append(f"{mod} imports {target}")
    return bad


# The one module per third-party library that reaches into its private names.
THIRD_PARTY_PRIVATE = {"onnx": "lnfold.onnx_rewrite.read", "torch": "lnfold.fx_rewrite.hf"}


def private_imports(srcs: dict[str, str], packages: set[str]) -> list[str]:
    """`from other_lnfold_module import _name` (a private name of another module), and a
    third-party private name imported outside its one module (THIRD_PARTY_PRIVATE)."""
    bad = []
    for mod, src in srcs.items():
        for target, names in imports(mod, src, mod in packages):
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            top = target.split(".")[0]
            if top == "lnfold" and target != mod:
                bad += [f"{mod} imports {target}.{n}" for n in private]
            elif top != "lnfold" and private and THIRD_PARTY_PRIVATE.get(top) != mod:
                bad += [f"{mod} imports {target}.{n}" for n in private]
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import rings inside each package (strongly connected components of more than one module,
    or a module that imports itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def package(m: str) -> str:
        return m.rpartition(".")[0]

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if package(w) != package(v) or w == package(v):  # inside one package; a package's
                continue  # __init__ re-exporting its modules is not a ring
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                on.discard(w)
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                out.append(sorted(ring))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def tree():
    packages = {_module_name(p) for folder in PACKAGES for p in (ROOT / folder).rglob("__init__.py")}
    return sources(), packages


def test_core_imports_neither_onnx_nor_torch(tree):
    assert core_imports_of_frameworks(*tree) == []


def test_no_private_name_is_imported_across_modules(tree):
    assert private_imports(*tree) == []


def test_no_import_ring_inside_a_package(tree):
    srcs, packages = tree
    assert cycles(graph(srcs, packages)) == []


# --- each check fails on a planted violation ------------------------------------------------------

def _planted(tree, module: str, line: str):
    srcs, packages = tree
    return {**srcs, module: srcs[module] + f"\n\ndef _planted():\n    {line}\n"}, packages


def test_a_planted_framework_import_in_the_core_is_caught(tree):
    assert core_imports_of_frameworks(*_planted(tree, "lnfold.passes.plan", "import torch")) \
        == ["lnfold.passes.plan imports torch"]


def test_a_planted_private_import_is_caught(tree):
    planted = _planted(tree, "lnfold.fx_rewrite.train", "from .api import _planted")
    assert private_imports(*planted) == ["lnfold.fx_rewrite.train imports lnfold.fx_rewrite.api._planted"]


def test_a_planted_third_party_private_import_is_caught(tree):
    planted = _planted(tree, "lnfold.onnx_rewrite.write", "from onnx.external_data_helper import _get_all_tensors")
    assert private_imports(*planted) == ["lnfold.onnx_rewrite.write imports onnx.external_data_helper._get_all_tensors"]


def test_a_planted_ring_behind_a_function_level_import_is_caught(tree):
    srcs, packages = _planted(tree, "lnfold.passes.weights", "from .plan import Plan")  # plan -> ... -> weights
    assert cycles(graph(srcs, packages)) != []


_PLACEHOLDER = __import__("re").compile(r"\{[A-Za-z_][\w.]*(\[[^\]]*\])?(![rsa])?(:[^{}]*)?\}")


def literal_placeholders(srcs: dict[str, str]) -> list[str]:
    """Plain string pieces joined to an f-string that hold `{name}`: half of a message that was
    meant to be formatted and prints the braces instead (the reader sees a literal `{self.who}`)."""
    out = []
    for module, src in srcs.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.JoinedStr):
                out += [f"{module}:{node.lineno}: {v.value.strip()[:60]!r}" for v in node.values
                        if isinstance(v, ast.Constant) and isinstance(v.value, str) and _PLACEHOLDER.search(v.value)]
    return out


def test_no_message_prints_a_literal_placeholder(tree):
    srcs, _ = tree
    assert literal_placeholders(srcs) == []
    planted = {"m": 'x = (f"{a} reads the stream; "\n     "{self.who} cannot edit it")\n'}
    [hit] = literal_placeholders(planted)
    assert hit.startswith("m:1:") and "{self.who} cannot edit it" in hit
