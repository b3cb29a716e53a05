"""The documentation stays true to the code: every dotted ``offload_adam.*`` name written in the
docstrings and comments of the package, in ARCHITECTURE.md, README.md, CONTRIBUTING.md,
examples/README.md and docs/ resolves to something the code has."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest

import offload_adam

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(offload_adam.__file__).resolve().parent
NAME = re.compile(r"\boffload_adam(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolve(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute reached from the longest importable module."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p)
        except AttributeError:
            return False
        return True
    return False


def _recorded_names() -> set[str]:
    """The names the package gives its ``torch.profiler.record_function`` ranges: dotted, but
    not Python names (the docs name them for profiler traces)."""
    names = set()
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "record_function"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    return names


def _python_texts(f: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a source file."""
    src = f.read_text()
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _documents() -> list[Path]:
    docs = [ROOT / "ARCHITECTURE.md", ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "examples" / "README.md"]
    return [d for d in docs if d.exists()] + sorted((ROOT / "docs").rglob("*.md"))


def test_every_dotted_name_in_docstrings_and_docs_resolves() -> None:
    recorded = _recorded_names()
    assert {"offload_adam.d2h", "offload_adam.h2d"} <= recorded  # the scan finds them
    seen: dict[str, list[str]] = {}
    for f in sorted(PKG.rglob("*.py")) + sorted((ROOT / "examples").glob("*.py")):
        for line, text in _python_texts(f):
            for m in NAME.finditer(text):
                seen.setdefault(m.group(), []).append(f"{f.relative_to(ROOT)}:{line + text.count(chr(10), 0, m.start())}")
    for d in _documents():
        for i, text in enumerate(d.read_text().splitlines(), 1):
            for m in NAME.finditer(text):
                seen.setdefault(m.group(), []).append(f"{d.relative_to(ROOT)}:{i}")
    assert len(seen) > 20  # the scan reads what it should
    stale = {n: where for n, where in seen.items() if n not in recorded and not _resolve(n)}
    assert not stale, "names that do not resolve (rename them in the text):\n" + "\n".join(
        f"  {n}: {', '.join(w)}" for n, w in sorted(stale.items())
    )


@pytest.mark.parametrize(
    "name, ok",
    [
        ("offload_adam.AdamW", True),
        ("offload_adam.optim.state.layout", True),
        ("offload_adam._native.io_backend", True),
        ("offload_adam.state.layout", False),  # before the reorganisation
        ("offload_adam.checkpoint", False),
        ("offload_adam.AdamW.no_such_method", False),
    ],
)
def test_the_resolver_tells_stale_names(name: str, ok: bool) -> None:
    assert _resolve(name) is ok


def _args_section(doc: str) -> dict[str, str]:
    """The entries of a Google-style ``Args:`` section: name -> its description."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    indent = len(lines[start]) - len(lines[start].lstrip())
    name = None
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the section ended
        m = re.match(r"\s+(\w+): (.*)", line)
        if m and len(line) - len(line.lstrip()) == indent + 4:
            name = m.group(1)
            out[name] = m.group(2)
        elif name is not None:
            out[name] += " " + line.strip()
    return out


def _public_callables() -> list[tuple[str, Any, Any]]:
    """(name, the callable whose signature counts, the object whose docstring documents it):
    the package's public functions and classes, and the methods those classes define."""
    import inspect

    out = []
    for n in offload_adam.__all__:
        obj = getattr(offload_adam, n)
        if inspect.isfunction(obj):
            out.append((n, obj, obj))
        elif inspect.isclass(obj):
            if not n.endswith("Offload"):  # the handles are made by offload_weights/activations
                out.append((n, obj.__init__, obj))
            for m, f in vars(obj).items():
                if not m.startswith("_") and inspect.isfunction(f):
                    out.append((f"{n}.{m}", f, f))
    return out


def test_every_public_argument_is_documented_with_its_default() -> None:
    import inspect

    missing = []
    checked = 0
    for name, fn, holder in _public_callables():
        doc = inspect.getdoc(holder) or ""
        args = _args_section(doc)
        for p in list(inspect.signature(fn).parameters.values()):
            if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            checked += 1
            if p.name not in args:
                missing.append(f"{name}: {p.name} is not in Args")
            elif p.default is not p.empty and "default" not in args[p.name].lower():
                missing.append(f"{name}: {p.name} does not say its default ({p.default!r})")
    assert checked > 50
    assert not missing, "\n".join(missing)


def test_help_of_adamw_shows_every_argument() -> None:
    import pydoc

    text = pydoc.render_doc(offload_adam.AdamW, renderer=pydoc.plaintext)
    for arg in ("nvme_dir:", "host_budget_gb:", "nvme_read_ahead:", "offload:", "state_dtype:", "free_gradients:"):
        assert arg in text
    assert "default: 1e-2" in text and "decoupled_weight_decay" not in _args_section(offload_adam.AdamW.__doc__ or "")
    assert "decoupled_weight_decay" in _args_section(offload_adam.Adam.__doc__ or "")


# -- the README is a portal ----------------------------------------------------------------------


def test_readme_is_a_portal_in_the_agreed_order() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15 * 1024
    heads = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert heads == ["Install", "Quickstart", "Which offload do I need?", "Figures", "Examples", "Limits", "Documentation", "License"]
    intro = text[: text.index("## Install")]
    assert "Nothing has run on a GPU yet" in intro  # the status, on the first screen
    install = text[text.index("## Install") : text.index("## Quickstart")]
    assert "pip install ." in install and "pip install dist/offload_adam-*.whl" in install
    assert "make demo" in install and "make test" in install and "3.10" in install and "2.15.0" in install
    quick = text[text.index("## Quickstart") : text.index("## Which offload")]
    assert quick.count("```python") == 4  # the four quickstart snippets (the fourth: the machine without a GPU, issue 37)
    assert text.count("```python") == 5  # and the quantized weights' one call (issue 24: the README shows it)
    assert "python -m offload_adam plan" in text
    # every relative link points at a file of the repository
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / target).exists(), target


def test_readme_planner_figures_are_the_planners(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The README quotes the planner's 13B recommendation: it must stay what the planner prints."""
    from offload_adam.tools.plan import main

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))  # the default bandwidths
    text = " ".join((ROOT / "README.md").read_text().split())
    case = ["--params", "13B", "--gpu-gb", "24", "--host-gb", "64", "--nvme-gb", "1000"]
    main(case)
    rec = capsys.readouterr().out.split("Recommended")[1]
    host = float(re.search(r"host ([\d.]+) GiB", rec).group(1))  # type: ignore[union-attr]
    nvme = float(re.search(r"NVMe ([\d.]+) GiB", rec).group(1))  # type: ignore[union-attr]
    secs = float(re.search(r"at least ([\d.]+) s per step", rec).group(1))  # type: ignore[union-attr]
    tb = float(re.search(r"([\d.]+) TB written", rec).group(1))  # type: ignore[union-attr]
    assert "bf16 moments" in rec and "Kahan" in rec and "bound by the SSD" in rec
    assert f"({host:.0f} GiB of RAM, {nvme:.0f} GiB on the SSD, at least {secs:.0f} s per step bound by a 3 GB/s SSD, {tb:.0f} TB written per 1000 steps)" in text
    main([*case, "--inference"])
    rec = capsys.readouterr().out.split("Recommended")[1]
    budget = re.search(r"gpu_budget_gb=(\S+),", rec).group(1)  # type: ignore[union-attr]
    rate = float(re.search(r"at most ([\d.]+) tokens/s", rec).group(1))  # type: ignore[union-attr]
    assert f"`gpu_budget_gb={budget}`: at most about {rate:.1f} tokens/s" in text


def test_the_planner_page_shows_what_the_planner_prints(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """docs/plan.md quotes whole runs of the planner (``$ python -m offload_adam plan ...`` and
    its output, in a code block): each must be what this version prints."""
    from offload_adam.tools.plan import main

    monkeypatch.setenv("OFFLOAD_ADAM_CACHE_DIR", str(tmp_path))  # the default bandwidths, as the page says
    page = (ROOT / "docs" / "plan.md").read_text()
    runs = re.findall(r"```\n\$ python -m offload_adam plan ([^\n]*)\n(.*?)\n```", page, re.S)
    assert len(runs) == 2
    for args, shown in runs:
        main(args.split())
        assert capsys.readouterr().out.rstrip("\n") == shown, args
