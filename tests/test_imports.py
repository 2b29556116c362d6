"""Import structure: no cycles between our modules, every module imports on its own,
the package imports lazily, and a missing MLX gets an error that names the fix."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "mlx_lm"
REPO_DIR = PACKAGE_DIR.parent
# Scripts that run when imported (`python -m mlx_lm` runs __main__).
SCRIPTS = {"mlx_lm.__main__"}


def module_names():
    """Every module of mlx_lm and mlx_lm.models, dotted, packages included."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(REPO_DIR).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_modules(name: str, known: set) -> set:
    """Our modules that `name` imports anywhere (top level or inside functions)."""
    path = REPO_DIR.joinpath(*name.split("."))
    is_package = path.is_dir()
    tree = ast.parse((path / "__init__.py" if is_package else path.with_suffix(".py")).read_text())
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import x` imports pkg, and pkg.x when x is a module.
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def edges_on_cycles(graph: dict) -> list:
    """Every import a -> b that closes a cycle (b leads back to a)."""
    return sorted((a, b) for a in graph for b in graph[a] if a in reachable(graph, b))


def test_edges_on_cycles_finds_them_all():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert edges_on_cycles(graph) == [("a", "b"), ("b", "c"), ("c", "a"), ("d", "e"), ("e", "d")]
    assert edges_on_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_module_import_graph_has_no_cycle():
    """DESIGN.md §1: each module imports only modules below it."""
    known = set(module_names())
    graph = {name: imported_modules(name, known) for name in known}
    cycles = edges_on_cycles(graph)
    assert not cycles, "imports on a cycle: " + ", ".join(f"{a} -> {b}" for a, b in cycles)
    assert {"mlx_lm.models.cache_files", "mlx_lm.tokenizer_utils"} <= graph["mlx_lm.cache_prompt"] | set().union(
        *(graph[m] for m in graph["mlx_lm.cache_prompt"])
    )  # the parser sees relative imports


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)


# Imports each module named in argv in a child forked from an interpreter that holds only
# third-party modules (MLX, numpy, transformers), none of ours: as good as a fresh
# interpreter for finding order dependence among our modules, at a fraction of the cost.
# Except that a module's child forks from one that has imported its package (mlx_lm.models
# for mlx_lm.models.gemma): importing a module imports its package first, in full, so that
# is where its import starts anyway, and the package's own modules (mlx_lm.models imports
# the caches) are not imported again for every family. The package itself
# is imported alone from its own package's child (mlx_lm.models from mlx_lm's).
# Prints {name: [exit status, stderr]} as JSON.
FORKED_IMPORTS = """
import importlib, json, os, sys, tempfile, traceback
os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # the parent's own import notice
import mlx.core, mlx.nn, numpy
from transformers import AutoTokenizer, PreTrainedTokenizerBase
assert not [m for m in sys.modules if m.split(".")[0] == "mlx_lm"]
del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]


def import_alone(name):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.dup2(write_end, 2)
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stderr.flush()
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as child_stderr:
        stderr = child_stderr.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), stderr


def import_each_under(package, names):
    # Each of names alone, from a child that has imported package ("": none of ours).
    if not package:
        return {name: import_alone(name) for name in names}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(package)
                results = {name: import_alone(name) for name in names}
            except BaseException:  # then each of names fails alone too
                results = {name: (1, traceback.format_exc()) for name in names}
            with open(out.name, "w") as f:
                json.dump(results, f)
            os._exit(0)
        os.waitpid(pid, 0)
        return json.load(out)


by_package = {}
for name in sys.argv[1:]:
    by_package.setdefault(name.rpartition(".")[0], []).append(name)
results = {}
for package, names in by_package.items():
    results.update(import_each_under(package, names))
print(json.dumps(results))
"""


def test_every_module_imports_alone():
    names = [n for n in module_names() if n not in SCRIPTS]
    # The limit only catches a hang: ~150 modules took 118 s on a loaded 2-core host.
    result = subprocess.run([sys.executable, "-c", FORKED_IMPORTS, *names], capture_output=True, text=True,
                            timeout=400, cwd=REPO_DIR)
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    assert sorted(results) == sorted(names)
    failed = {n: stderr.strip().splitlines()[-1] for n, (code, stderr) in results.items() if code != 0}
    assert not failed, failed
    noisy = {n: stderr for n, (_, stderr) in results.items() if stderr}
    assert not noisy, noisy  # no warnings


def test_package_imports_lazily_and_keeps_upstreams_names():
    result = run_python(
        "import sys, types\n"
        "import mlx_lm\n"
        "assert not {'mlx_lm.generate', 'mlx_lm.convert', 'mlx_lm.utils'} & set(sys.modules), [m for m in sys.modules if 'mlx_lm' in m]\n"
        "assert mlx_lm.__version__\n"
        "import mlx_lm.generate, mlx_lm.convert, mlx_lm.server\n"
        "from mlx_lm import convert, generate, load, stream_generate\n"
        "for f in (convert, generate, load, stream_generate, mlx_lm.generate, mlx_lm.convert):\n"
        "    assert isinstance(f, types.FunctionType), f\n"
        "assert generate.__module__ == 'mlx_lm.generate' and convert.__module__ == 'mlx_lm.convert'\n"
        "try:\n"
        "    mlx_lm.nothing\n"
        "except AttributeError as e:\n"
        "    assert 'nothing' in str(e)\n"
        "else:\n"
        "    raise AssertionError('mlx_lm.nothing exists')\n"
    )
    assert result.returncode == 0, result.stderr


BLOCK_MLX = """
import sys

class BlockMLX:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx" or name.startswith("mlx."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, BlockMLX())
"""


@pytest.mark.parametrize("module", ["mlx_lm", "mlx_lm.generate"])
def test_missing_mlx_names_the_extra_to_install(module):
    result = run_python(BLOCK_MLX + f"import {module}\n")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ModuleNotFoundError: mlx_lm needs MLX"), result.stderr
    assert 'pip install -e ".[cpu]"' in last_line and '".[cuda12]"' in last_line and '".[cuda13]"' in last_line


def console_scripts() -> dict:
    """setup.py's console scripts: name -> (module, function)."""
    entries = re.findall(r'"([\w.]+) = ([\w.]+):(\w+)"', (REPO_DIR / "setup.py").read_text())
    return {name: (module, function) for name, module, function in entries}


def run_console_script(name: str, *args: str, block_mlx: bool) -> subprocess.CompletedProcess:
    """`name` run as the script pip writes for it: import the function, exit with its result."""
    module, function = console_scripts()[name]
    code = (BLOCK_MLX if block_mlx else "") + (
        f"import sys\nsys.argv[0] = {name!r}\nfrom {module} import {function}\nsys.exit({function}())\n"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO_DIR)


def test_every_command_has_a_console_script_outside_the_package():
    from mlx_lm.cli import COMMANDS

    expected = {f"mlx_lm.{c}": ("_mlx_lm_console", c) for c in COMMANDS}
    assert console_scripts() == {"mlx_lm": ("_mlx_lm_console", "main"), **expected}


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_scripts_report_a_missing_mlx_in_one_line(name):
    result = run_console_script(name, "--help", block_mlx=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("mlx_lm needs MLX, which is not installed (No module named 'mlx")
    assert result.stderr.count("\n") == 1 and 'pip install -e ".[cpu]"' in result.stderr, result.stderr

