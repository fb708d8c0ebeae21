"""The rules that import-linter cannot state: few function-level imports of project modules, each with its
reason written beside it, a CLI whose --help loads no heavy library (issue 22), no class with more than
MAX_PUBLIC_METHODS public methods or MAX_CLASS_LINES lines and no function over MAX_FUNCTION_LINES lines (a class
that grows past it is split, as the Store is per aggregate, the API per phase, the learner and the client's join
loop per part: issue 33; no exception is listed), and an API whose
modules are handed the collaborators they use, not the whole role."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "shared", "swarm_client", "echo_swarm")
MAX_LAZY = 15
HEAVY = ("torch", "transformers", "hivemind", "llama_cpp")
MAX_PUBLIC_METHODS = 15
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


#: upstream code kept byte for byte (llama.cpp's converter and its gguf-py, checked against SHA256SUMS): not ours to
#: reshape, so the limits below measure our code only
VENDORED = "vendor_llama_cpp"


def _our_files(package: str) -> list[Path]:
    return [p for p in sorted((ROOT / package).rglob("*.py")) if VENDORED not in p.parts]


def _lazy_imports() -> list[tuple[str, int, bool]]:
    """(file, line, commented) of each import of a project module inside a function, outside tests/ and bench/."""
    found = []
    for package in PACKAGES:
        for path in _our_files(package):
            source = path.read_text(encoding="utf-8")
            lines = source.splitlines()
            for fn in ast.walk(ast.parse(source)):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom):
                        names = [node.module or ""] if node.level == 0 else [PACKAGES[0]]  # relative: in-project
                    elif isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    else:
                        continue
                    if any(n.split(".")[0] in PACKAGES for n in names):
                        own = lines[node.lineno - 1]
                        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                        commented = "#" in own or above.startswith("#")
                        found.append((str(path.relative_to(ROOT)), node.lineno, commented))
    return sorted(set(found))


def test_function_level_project_imports_are_few_and_each_says_why() -> None:
    lazy = _lazy_imports()
    assert len(lazy) < MAX_LAZY, (f"{len(lazy)} function-level imports of project modules (at most {MAX_LAZY - 1}); "
                                  f"import at module level unless the module loads torch/hivemind/aiohttp for a "
                                  f"light entrypoint: " + ", ".join(f"{f}:{n}" for f, n, _ in lazy))
    silent = [f"{f}:{n}" for f, n, commented in lazy if not commented]
    assert not silent, f"function-level imports without a comment saying why (on the line or above): {silent}"


def test_the_walk_finds_a_function_level_import() -> None:
    """The counter is not vacuous: the imports it finds are real (the CLI's lazy runner import is one of them)."""
    assert any(f == "echo_swarm/cli.py" for f, _, _ in _lazy_imports())


def _modules_loaded(*argv: str) -> set[str]:
    """Top-level names of the modules `python -m echo_swarm ARGV` imports, read from sys.modules at exit."""
    code = ("import atexit, sys\n"
            "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))\n"
            "sys.argv = ['echo-swarm', *sys.argv[1:]]\n"
            "import runpy; runpy.run_module('echo_swarm', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Usage" in out.stdout, out.stdout[-500:]
    line = [x for x in out.stderr.splitlines() if x.startswith("MODULES ")][-1]
    return {m.split(".")[0] for m in line.split()[1:]}


def test_help_imports_no_heavy_library() -> None:
    for argv in (["--help"], ["join", "--help"], ["coordinator", "--help"]):
        loaded = _modules_loaded(*argv)
        assert "echo_swarm" in loaded and "typer" in loaded  # the probe saw the CLI run
        assert not loaded & set(HEAVY), f"`echo-swarm {' '.join(argv)}` imported {sorted(loaded & set(HEAVY))}"


def _definitions() -> dict[str, tuple[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """``file:Qual.name`` → (definition, package-relative file) of every class and function in the packages."""
    found: dict[str, tuple[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, str]] = {}

    def visit(node: ast.AST, prefix: str, file: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found[f"{file}:{name}"] = (child, file)
                visit(child, f"{name}.", file)
            else:
                visit(child, prefix, file)

    for package in PACKAGES:
        for path in _our_files(package):
            visit(ast.parse(path.read_text(encoding="utf-8")), "", path.relative_to(ROOT).as_posix())
    return found


def _public_methods() -> dict[str, int]:
    """``file:Class`` → how many public methods (a ``def`` or ``async def`` in the class body whose name does not
    start with an underscore; properties and static methods included) of every class in the packages."""
    return {name: sum(1 for item in node.body
                      if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_"))
            for name, (node, _) in _definitions().items() if isinstance(node, ast.ClassDef)}


def _lines(kind: type | tuple[type, ...]) -> dict[str, int]:
    """``file:Qual.name`` → lines (decorators excluded) of every definition of ``kind``."""
    return {name: (node.end_lineno or node.lineno) - node.lineno + 1
            for name, (node, _) in _definitions().items() if isinstance(node, kind)}


def test_no_class_has_more_than_15_public_methods() -> None:
    counts = _public_methods()
    assert max(counts.values()) > MAX_PUBLIC_METHODS // 2  # the walk counts the classes' methods
    big = {name: n for name, n in counts.items() if n > MAX_PUBLIC_METHODS}
    assert not big, f"classes with more than {MAX_PUBLIC_METHODS} public methods (split them): {big}"


def test_no_class_over_300_lines_and_no_function_over_60() -> None:
    classes = _lines(ast.ClassDef)
    functions = _lines((ast.FunctionDef, ast.AsyncFunctionDef))
    assert max(classes.values()) > MAX_CLASS_LINES // 2  # the walk measures whole class bodies
    assert functions["coordinator/api/service.py:Coordinator.start"] > 10  # methods are measured by their qualname
    big = {name: n for name, n in classes.items() if n > MAX_CLASS_LINES}
    big |= {name: n for name, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert not big, (f"classes over {MAX_CLASS_LINES} lines or functions over {MAX_FUNCTION_LINES} (split them: "
                     f"one concern each, as coordinator/api/ is one module per phase): {big}")


def test_only_the_composition_takes_the_api_role() -> None:
    """coordinator/api/ is no star around one object: its modules are handed the collaborators they use (the
    run's reads, the operator's actions, the intake's figures); only the composition (app.py) and the role's own
    module (service.py) name the role, ``Coordinator``."""
    named = set()
    for path in sorted((ROOT / "coordinator" / "api").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Name) and node.id == "Coordinator" for node in ast.walk(tree)):
            named.add(path.name)
    assert "app.py" in named  # the walk sees the name where it is used
    assert named <= {"app.py", "service.py"}, f"api modules that take the whole API role: {named - {'app.py'}}"


#: 33 since issue 35: a family's config overrides (any Hugging Face config key), tokenizer.json's pre-tokenizer JSON and
#: the attributes of the converter subclass built with type() are open shapes by nature
MAX_OPEN_DICTS = 33
OPEN_DICT = "dict[str, " + "Any]"  # split so that this file's own text is no occurrence of it


def _open_dicts() -> list[str]:
    """``file:line`` of each line of coordinator/ that names the open dict type (as ``grep -rn`` counts them)."""
    return [f"{path.relative_to(ROOT).as_posix()}:{n}"
            for path in _our_files("coordinator")
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if OPEN_DICT in line]


def test_coordinator_has_at_most_33_open_dicts() -> None:
    """Issue 22: records that cross a function, module or role boundary are typed (coordinator.store.records,
    coordinator.run.records, coordinator.api.replies), so that mypy checks every read; the open dict stays only
    where the shape really is open (user configs, dataset rows, client profiles, the learner's metrics)."""
    found = _open_dicts()
    assert found, "the count is not vacuous: some open shapes remain (e.g. coordinator/config.py)"
    assert len(found) <= MAX_OPEN_DICTS, (
        f"{len(found)} lines of coordinator/ use {OPEN_DICT} (at most {MAX_OPEN_DICTS}): give the record a type "
        f"instead — a frozen dataclass (or a pydantic model for JSON another process wrote) read by attribute, or "
        f"a TypedDict for a JSON reply built to be served as it is; keep {OPEN_DICT} only for a genuinely open "
        f"shape, and no alias of it: " + ", ".join(found))
