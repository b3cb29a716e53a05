"""``python -m offload_adam.tools.sizes [--max-methods N] [--max-lines N] PATH...``: the size of
the house's classes and functions, read with ``ast`` (nothing imported).

A class: its methods (the ``def``s of its body) and attributes (the distinct ``self.X`` assigned in
its methods, plus its class-level annotated fields). A function (or method): its lines from
``def`` to its last line, its docstring not counted (comments and blank lines inside are). With a
limit, the classes and functions over it are listed and the exit status is 1 (issue 33: no class
in ``weights/`` over 20 methods, no function in ``weights/`` or ``runtime/`` over 70 lines).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Iterator


def _files(paths: list[str]) -> Iterator[str]:
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in sorted(os.walk(p)):
                yield from (os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
        else:
            yield p


def _doc_lines(fn: ast.AST) -> int:
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        return int(body[0].end_lineno or body[0].lineno) - body[0].lineno + 1
    return 0


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``fn`` (decorators excluded), its docstring not counted."""
    return int(fn.end_lineno or fn.lineno) - fn.lineno + 1 - _doc_lines(fn)


def class_size(cls: ast.ClassDef) -> tuple[int, int]:
    """(methods, attributes) of ``cls``."""
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    attrs = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for m in methods:
        for node in ast.walk(m):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                        attrs.add(x.attr)
    return len(methods), len(attrs)


def measure(paths: list[str]) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
    """(classes as (where, methods, attributes), functions as (where, lines)) of the files under ``paths``."""
    classes: list[tuple[str, int, int]] = []
    functions: list[tuple[str, int]] = []
    for f in _files(paths):
        with open(f, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), f)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((f"{f}:{node.lineno} {node.name}", *class_size(node)))
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        functions.append((f"{f}:{m.lineno} {node.name}.{m.name}", function_lines(m)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.col_offset == 0:
                functions.append((f"{f}:{node.lineno} {node.name}", function_lines(node)))
    return classes, functions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offload_adam.tools.sizes", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="files or folders")
    ap.add_argument("--max-methods", type=int, default=None, help="list the classes with more methods (exit 1)")
    ap.add_argument("--max-lines", type=int, default=None, help="list the functions with more lines (exit 1)")
    ap.add_argument("--top", type=int, default=10, help="the largest N classes and functions (default 10)")
    args = ap.parse_args(argv)
    classes, functions = measure(args.paths)
    print("classes (methods / attributes):")
    for where, m, a in sorted(classes, key=lambda c: (-c[1], -c[2]))[: args.top]:
        print(f"  {m:3d} / {a:3d}  {where}")
    print("functions (lines, docstring not counted):")
    for where, n in sorted(functions, key=lambda f: -f[1])[: args.top]:
        print(f"  {n:4d}  {where}")
    over = [f"class {w}: {m} methods" for w, m, _ in classes if args.max_methods is not None and m > args.max_methods]
    over += [f"function {w}: {n} lines" for w, n in functions if args.max_lines is not None and n > args.max_lines]
    for o in over:
        print(f"OVER: {o}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
