"""The Rust crate's structure (issue 33, point 4): its modules import one another without a cycle,
and the code paths take their CPU features from ``isa.rs``'s one table (``simd_features!``).

Read from the sources (``rust/``): no build needed. Test code (``tests.rs`` files and inline
``#[cfg(test)] mod tests``) is left out; an import between a module and one of its ancestors (a
parent's ``mod``/``pub use`` of its children, a child's ``super::``) is how Rust nests modules and
is not counted.
"""

from __future__ import annotations

import re
from pathlib import Path

RUST = Path(__file__).resolve().parent.parent / "rust"

_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_COMMENT = re.compile(r"//[^\n]*")
_TESTS = re.compile(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{")
_PATH = re.compile(r"\b((?:crate|super|self)(?:::\w+)+)")
_USE = re.compile(r"\buse\s+([^;]+);")


def _module(path: Path) -> str:
    parts = list(path.relative_to(RUST).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return "::".join(parts)


def _code(path: Path) -> str:
    """The file's code without comments, string literals and inline test modules."""
    src = _STRING.sub('""', _COMMENT.sub("", path.read_text()))
    while m := _TESTS.search(src):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        src = src[: m.start()] + src[i:]
    return src


def _expand(use: str) -> list[str]:
    """``a::{b, c::{d, e}}`` as ``a::b``, ``a::c::d``, ``a::c::e``."""
    use = "".join(use.split())
    if "{" not in use:
        return [use]
    head, body = use.split("{", 1)
    body = body[: body.rindex("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    items.append(cur)
    return [p for item in items if item for p in _expand(head + item)]


def _graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    files = {_module(p): p for p in RUST.rglob("*.rs") if p.name != "tests.rs"}
    codes = {m: _code(p) for m, p in files.items()}

    def resolve(mod: str, path: str) -> str | None:
        parts = path.split("::")
        base = mod.split("::") if mod else []
        if parts[0] == "crate":
            base, parts = [], parts[1:]
        while parts and parts[0] in ("super", "self"):
            if parts.pop(0) == "super":
                base = base[:-1]
        names = base + parts
        for k in range(len(names), 0, -1):
            if "::".join(names[:k]) in files:
                return "::".join(names[:k])
        return None

    def related(a: str, b: str) -> bool:
        return a == b or not a or not b or a.startswith(b + "::") or b.startswith(a + "::")

    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, code in codes.items():
        paths = _PATH.findall(code) + [p for u in _USE.findall(code) for p in _expand(u)]
        for path in paths:
            target = resolve(mod, path.split(" as ")[0])
            if target is not None and not related(mod, target):
                edges[mod].add(target)
    return edges, codes


def test_rust_modules_import_one_another_without_a_cycle() -> None:
    edges, _ = _graph()
    cycles = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(edges[node]):
            if nxt == start:
                cycles.append(" -> ".join(path + [start]))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for mod in sorted(edges):
        walk(mod, mod, [mod])
    assert not cycles, "module cycles in rust/:\n" + "\n".join(cycles)


def test_target_features_come_from_isa_table() -> None:
    _, codes = _graph()
    by_hand = [m for m, code in codes.items() if m != "isa" and re.search(r"enable\s*=\s*\"", code)]
    assert not by_hand, f"#[target_feature] strings written by hand (take them from isa::simd_features!): {by_hand}"
