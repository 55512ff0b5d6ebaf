"""The rooms import one way down the pipeline (docs/development.md, issue 44): a lower room never imports a higher
one, lazily inside a function or not, so no two rooms import each other. Read from the source with
`ast`: every `import specpack.X` / `from specpack.X import ...` is an edge from its module's room."""

import ast
from pathlib import Path

import specpack

# top to bottom; a room may import only rooms below it (and the package's own _private modules)
ORDER = ["demo", "cli", "engines", "exports", "serving", "tuning", "distill", "runtime", "packager", "converters",
         "families", "schemas"]
SHARED = {"errors", "_atomic", "_paths", "_machine", "_net", "_output", "_redact", "_version", "__init__", "__main__"}
ROOT = Path(specpack.__file__).parent


def room_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def edges():
    """(importing room, imported room, file:line) for every specpack import."""
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        src = room_of("specpack." + ".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specpack"):
                names = [node.module + "." + a.name for a in node.names] if node.module == "specpack" else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("specpack.")]
            else:
                continue
            for name in names:
                yield src, room_of(name), f"{rel}.py:{node.lineno}"


def test_every_room_is_known():
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in ROOT.glob("*.py")}
    assert rooms - SHARED - {"__version__"} <= set(ORDER), rooms - SHARED - set(ORDER)


def test_imports_point_down():
    upward = [f"{where}: {src} imports {dst}" for src, dst, where in edges()
              if src in ORDER and dst in ORDER and ORDER.index(dst) < ORDER.index(src)]
    assert not upward, "\n".join(upward)


def test_shared_modules_import_no_room():
    found = [f"{where}: {src} imports {dst}" for src, dst, where in edges()
             if src in SHARED - {"__init__", "__main__"} and dst in ORDER]
    assert not found, "\n".join(found)


# ---- inside the rooms: no module imports itself back, and runtime's floors (issue 52) ----

RUNTIME_FLOORS = ["api", "backends", "spec_model", "engine", "drafters", "models", "kernels", "options", "text"]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_edges():
    """(importer, imported module) for every specpack import, lazy ones included, resolved to modules."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specpack"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in modules else node.module for t in targets]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("specpack")]
            else:
                continue
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != name:
                    yield name, t


def _cycles(edges) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan), sorted."""
    graph: dict[str, set] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_module_imports_itself_back():
    assert _cycles(module_edges()) == []


def test_no_room_of_a_package_imports_itself_back():
    """Within every package, its rooms (subpackages and modules) form no circle either."""
    def room(module: str, package: str) -> str:
        return module[len(package) + 1:].split(".")[0] if module.startswith(package + ".") else "__init__"

    packages = sorted({_module(p) for p in ROOT.rglob("__init__.py")})
    found = {}
    for package in packages:
        edges = {(room(a, package), room(b, package)) for a, b in module_edges()
                 if a.startswith(package + ".") and b.startswith(package + ".")}
        found[package] = _cycles(e for e in edges if e[0] != e[1])
    assert {p: c for p, c in found.items() if c} == {}


def test_the_runtime_floors_point_down():
    """runtime/: options and text at the bottom, then kernels -> models -> drafters -> engine ->
    spec_model -> backends -> api: a floor imports only floors below it."""
    rooms = {p.name if p.is_dir() else p.stem for p in (ROOT / "runtime").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"} - {"__init__"}
    assert rooms == set(RUNTIME_FLOORS), rooms ^ set(RUNTIME_FLOORS)
    up = [f"{a} imports {b}" for a, b in module_edges() if a.startswith("specpack.runtime.") and
          b.startswith("specpack.runtime.") and
          RUNTIME_FLOORS.index(b.split(".")[2]) < RUNTIME_FLOORS.index(a.split(".")[2])]
    assert up == []


def test_the_c_kernels_call_no_file_back():
    """kernels/*.c: a file calls only the sp_* functions of files below it (panels.c and pool.c at the
    bottom: linear.c, w8a8.c and bf16_tiles.c call their helpers, never the reverse)."""
    import re

    files = sorted((ROOT / "runtime" / "kernels").glob("*.c"))
    code = {f.name: re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read_text(), flags=re.S) for f in files}
    defined = {m: name for name, text in code.items() for m in re.findall(r"^\w[\w \*]*?\b(sp_\w+)\s*\(", text, re.M)}
    edges = {(name, defined[c]) for name, text in code.items() for c in set(re.findall(r"\b(sp_\w+)\s*\(", text))
             if c in defined and defined[c] != name}
    assert _cycles(edges) == [], edges


def test_package_init_files_only_hand_names_on():
    """A package's code lives in its modules; its __init__.py imports and re-exports (the root's lazy
    `specpack.load`, which keeps `import specpack` cheap, aside)."""
    defining = [str(p.relative_to(ROOT)) for p in ROOT.rglob("__init__.py") if p.parent != ROOT and any(
        isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) for n in ast.parse(p.read_text()).body)]
    assert defining == []
