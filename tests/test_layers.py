"""The rooms import one way down the pipeline (DESIGN.md, issue 44): a lower room never imports a higher
one, lazily inside a function or not, so no two rooms import each other. Read from the source with
`ast`: every `import specpack.X` / `from specpack.X import ...` is an edge from its module's room."""

import ast
from pathlib import Path

import specpack

# top to bottom; a room may import only rooms below it (and the package's own _private modules)
ORDER = ["demo", "cli", "engines", "exports", "serving", "tuning", "distill", "runtime", "packager", "converters",
         "families", "schemas"]
SHARED = {"errors", "_atomic", "_paths", "_machine", "_net", "_output", "_redact", "__init__", "__main__"}
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
