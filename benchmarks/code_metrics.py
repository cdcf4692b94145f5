"""Structure counts of the package: what makes the engine hard to read, counted so that a change
can show it counted less.

Counts, from the source text (`ast`), never by running the package:

- mode-flag tests in the engine and its parts: `if` statements and conditional expressions whose
  test reads a mode flag, by flag (`single_micro`, the backward's mode, LoRA/frozen, cuda,
  resident, tied);
- kind dispatch on placements: `isinstance(..., <placement class>)`, `type(...) is`, and reads of
  the placement class flags (`.resident`, `.trainable`, `.host_state`) on a placement;
- calls of another object's private methods (`x._name(...)` with `x` not `self`, `cls` or `super()`);
- package files over 400 lines and functions over 80 lines;
- one-letter names bound in the package (assignments, loop targets, parameters), outside
  comprehensions and lambdas: the math's `x`, `n`, `i` among them, so a count to watch fall, not
  to reach zero.

Run from the repository root (`duplicates hf_slideformer` gives the repeated-code pairs):

    python benchmarks/code_metrics.py            # the table
    python benchmarks/code_metrics.py --list     # and every place counted
    git archive REV hf_slideformer | tar -x -C /tmp/rev && python benchmarks/code_metrics.py --package /tmp/rev/hf_slideformer
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_slideformer"

# The engine and the parts of its schedule (what a reader opens to follow one step).
ENGINE_PARTS = ("slide_engine.py", "schedule.py", "placements.py", "late_updates.py", "head.py", "lm_weight.py", "embedding.py",
                "embedding_table.py", "end_training.py",
                "resident.py", "device_update.py", "accumulate.py", "disk_placement.py", "lora.py",
                "host_tasks.py", "grad_ring.py", "step_norm.py", "sharded.py", "slots.py", "mode.py")

# flag -> pattern over the unparsed test expression
FLAGS = {
    "single_micro": r"\bsingle_micro\b",
    "backward mode": r"\bmode\.(updates|ends_step)\b|\bupdated_in_backward\b|\bends_step\b|\bupdates\b",
    "lora/frozen": r"\btrainable\b|\badapters?\.params\b|\bfrozen\b|\blora\b",
    "cuda": r"\bcuda\b|\bis_cuda\b",
    "resident": r"\bresident\b",
    "tied": r"\btied\b",
    # a part branching on the plan's decisions still branches on the mode: counted too
    "plan decision": r"\bplan\.\w+|\bbackward_plan\.\w+",
}
PLACEMENT_CLASSES = {"LayerPlacement", "HostLayer", "FrozenLayer", "DeviceUpdateLayer", "ResidentLayer",
                     "DiskLayer", "ShardedHostLayer"}
PLACEMENT_FLAGS = {"resident", "trainable", "host_state"}
PLACEMENT_NAMES = re.compile(r"^(p|place|places\[.*\]|.*place_of\(.*\)|self)$")


def _tests(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            yield node.lineno, ast.unparse(node.test)
        elif isinstance(node, ast.comprehension):
            for cond in node.ifs:
                yield cond.lineno, ast.unparse(cond)


def mode_flags(path: Path, tree: ast.AST) -> list[tuple[str, int, str]]:
    """(flag, line, test) for each test of a mode flag."""
    found = []
    for line, text in _tests(tree):
        for flag, pattern in FLAGS.items():
            if re.search(pattern, text):
                found.append((flag, line, text))
    return found


def kind_dispatch(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of isinstance / type-is / class-flag dispatch on placements."""
    found = []
    is_placement_module = path.name in ("placements.py",)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
            if names & PLACEMENT_CLASSES:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            left = node.left
            if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "type":
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if names & PLACEMENT_CLASSES:
                    found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Attribute) and node.attr in PLACEMENT_FLAGS and isinstance(node.ctx, ast.Load)
              and not is_placement_module and PLACEMENT_NAMES.match(ast.unparse(node.value))
              and ast.unparse(node.value) != "self"):
            found.append((node.lineno, ast.unparse(node)))
    return found


def private_calls(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of calls of another object's private method."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, owner = node.func.attr, node.func.value
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        text = ast.unparse(owner)
        if text in ("self", "cls", "super()", "torch", "np", "os", "sys") or text.startswith(("torch.", "sys.")):
            continue
        if isinstance(owner, ast.Name) and owner.id[:1].isupper():
            continue                  # a class's own helper called through the class name
        found.append((node.lineno, f"{text}.{attr}(...)"))
    return found


def long_functions(path: Path, tree: ast.AST, limit: int = 80) -> list[tuple[int, str, int]]:
    """(line, name, length) of functions longer than `limit` lines."""
    return [(n.lineno, n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def one_letter_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each one-letter name bound outside comprehensions and lambdas (`_` aside)."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            inner |= {id(name) for gen in node.generators for name in ast.walk(gen.target)}
        elif isinstance(node, ast.Lambda):
            inner |= {id(arg) for arg in ast.walk(node.args)}
    found = []
    for node in ast.walk(tree):
        if id(node) in inner:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        elif isinstance(node, ast.arg):
            name = node.arg
        else:
            continue
        if len(name) == 1 and name != "_":
            found.append((node.lineno, name))
    return found


def collect(package: Path = PACKAGE) -> dict:
    """Every count, and the places behind it, for the package at `package`."""
    root = package.parent
    out = {"flags": [], "dispatch": [], "private": [], "long_files": [], "long_functions": [], "one_letter": []}
    for path in sorted(list(package.glob("*.py")) + list(package.glob("*/*.py"))):
        src = path.read_text()
        tree = ast.parse(src)
        rel = path.relative_to(root)
        lines = src.count("\n")
        if lines > 400:
            out["long_files"].append((str(rel), lines))
        out["long_functions"] += [(f"{rel}:{ln}", name, n) for ln, name, n in long_functions(path, tree)]
        out["one_letter"] += [(f"{rel}:{ln}", name) for ln, name in one_letter_names(tree)]
        out["private"] += [(f"{rel}:{ln}", call) for ln, call in private_calls(path, tree)]
        out["dispatch"] += [(f"{rel}:{ln}", code) for ln, code in kind_dispatch(path, tree)]
        if path.name in ENGINE_PARTS and package in path.parents:     # the engine, host and disk parts
            out["flags"] += [(flag, f"{rel}:{ln}", text) for flag, ln, text in mode_flags(path, tree)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every place counted")
    parser.add_argument("--package", type=Path, default=PACKAGE,
                        help="the package folder to count (e.g. an older commit's, from git archive)")
    args = parser.parse_args(argv)
    out = collect(args.package.resolve())
    by_flag = Counter(flag for flag, *_ in out["flags"])
    tests = {(w, t) for _, w, t in out["flags"]}
    rows = [("mode-flag tests in the engine and its parts", len(tests)),
            ("  of which outside schedule.py", len({(w, t) for w, t in tests if "schedule.py" not in w}))]
    rows += [(f"  {flag}", by_flag[flag]) for flag in FLAGS]
    rows += [("kind dispatch on placements", len(out["dispatch"])),
             ("calls of another object's private methods", len(out["private"])),
             ("package files over 400 lines", len(out["long_files"])),
             ("functions over 80 lines", len(out["long_functions"])),
             ("one-letter names bound (outside comprehensions, lambdas)", len(out["one_letter"]))]
    if args.list:
        for flag, where, text in out["flags"]:
            print(f"flag {flag:14s} {where}: {text}")
        for key in ("dispatch", "private", "long_files", "long_functions", "one_letter"):
            for row in out[key]:
                print(key, *row)
        print()
    width = max(len(name) for name, _ in rows)
    for name, count in rows:
        print(f"{name:{width}s} {count:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
