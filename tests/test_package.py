"""The package's layering: every module imports on its own, no import cycle inside the package,
and the Trainer hook is installed by one explicit call, not by constructing arguments."""
import ast
import pathlib
import subprocess
import sys

import hf_slideformer

PACKAGE = pathlib.Path(hf_slideformer.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in its source (a function-level import
    is an edge too: it hides a cycle, it does not remove it)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:
                        graph[m].add(sub)
                    elif target in mods:
                        graph[m].add(target)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
        graph[m].discard(m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    assert "hf_slideformer.planner.planner" in graph and "hf_slideformer.models.registry" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    mods = sorted(_modules())
    _fresh("import importlib, sys\n"
           f"for m in {mods!r}:\n"
           "    for k in [k for k in sys.modules if k.startswith('hf_slideformer')]:\n"
           "        del sys.modules[k]\n"
           "    importlib.import_module(m)\n")


def test_slide_args_have_no_side_effect_and_the_hook_is_one_idempotent_call():
    out = _fresh(
        "import transformers\n"
        "from hf_slideformer.training_args import SlideArgs\n"
        "plain = transformers.Trainer.__init__\n"
        "SlideArgs(output_dir='o', report_to=[], use_cpu=True)\n"
        "print(transformers.Trainer.__init__ is plain)\n"
        "import hf_slideformer as hs\n"
        "hs.install_trainer_hook()\n"
        "hooked = transformers.Trainer.__init__\n"
        "hs.install_trainer_hook()\n"
        "print(hooked is not plain, transformers.Trainer.__init__ is hooked, hooked.__wrapped__ is plain)\n")
    assert out.split() == ["True", "True", "True", "True"]


def test_slide_args_from_the_package_install_the_hook():
    out = _fresh("import transformers, hf_slideformer as hs\n"
                 "plain = transformers.Trainer.__init__\n"
                 "hs.SlideArgs\n"
                 "print(transformers.Trainer.__init__ is not plain)\n")
    assert out.split() == ["True"]
