"""The GPU check's preflight (``.ci/gpu_check.sh``), and the stamp ``make wheel`` writes beside the wheel.

    python .ci/gpu_preflight.py stamp [--out dist/offload_adam-commit.json] [--no-wheel]
    python .ci/gpu_preflight.py check [--stamp dist/offload_adam-commit.json] [--site DIR] [--dry]

``stamp`` (``make wheel``, after the build): the commit the wheel was built from, whether the tree
had uncommitted changes, a digest of the sources that go into the wheel (the package's Python
files, the Rust crate, the build files) and the wheel's name and SHA-256, as JSON.

``check`` (the preflight, on the GPU machine): prints the versions of python, torch (and its CUDA),
transformers, accelerate, peft, torchao, diffusers and pytest, where ``offload_adam`` is imported
from, and the stamp; then fails (exit 1, saying why) when the wheel in ``dist/`` is not the one
stamped, when this tree's sources are not those the wheel was built from (a stale wheel would
otherwise pass for this commit), when ``offload_adam`` is not imported from ``--site`` (the wheel
installed there), or its extension does not load, or when CUDA is not available. With ``--dry``
(``GPU_CHECK_DRY=1``): the installed package, and no CUDA wanted; the stamp, if given, is checked
against the tree all the same.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("python/offload_adam", "rust", "Cargo.toml", "Cargo.lock", "pyproject.toml")
SKIP_SUFFIXES = (".so", ".pyc", ".pyd")


def source_files(root: Path = ROOT) -> list[Path]:
    """The files the wheel is built from, sorted (no caches, no built extension)."""
    out = []
    for name in SOURCES:
        p = root / name
        if p.is_file():
            out.append(p)
            continue
        for dirpath, dirnames, files in os.walk(p):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [Path(dirpath) / f for f in files if not f.endswith(SKIP_SUFFIXES)]
    return sorted(out)


def source_digest(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for f in source_files(root):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def wheels() -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(ROOT / "dist" / "offload_adam-*-abi3-*.whl")))


def stamp(out: Path, with_wheel: bool) -> int:
    rec: dict[str, object] = {
        "commit": _git("rev-parse", "HEAD") or "unknown (no git)",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", *SOURCES)),
        "sources": source_digest(),
        "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if with_wheel:
        ws = wheels()
        if len(ws) != 1:
            print(f"gpu_preflight stamp: want one wheel in dist/, found {[w.name for w in ws]}", file=sys.stderr)
            return 1
        rec["wheel"] = ws[0].name
        rec["wheel_sha256"] = file_digest(ws[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"gpu_preflight: {out} (commit {rec['commit']}{', uncommitted changes' if rec['dirty'] else ''})")
    return 0


def versions() -> None:
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    for name in ("torch", "transformers", "accelerate", "peft", "torchao", "diffusers", "pytest"):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # absent, or present and broken: said, not fatal here
            print(f"{name}: not importable ({type(e).__name__}: {str(e)[:120]})")
            continue
        extra = ""
        if name == "torch":
            extra = f", CUDA {mod.version.cuda}, available {mod.cuda.is_available()}"
        print(f"{name} {getattr(mod, '__version__', '?')}{extra}")


def check(stamp_path: Path | None, site: str | None, dry: bool) -> int:
    problems = []
    versions()
    if stamp_path is not None:
        if not stamp_path.is_file():
            problems.append(f"no {stamp_path} (make wheel writes it beside the wheel)")
        else:
            rec = json.loads(stamp_path.read_text())
            print(f"wheel stamp {stamp_path}: {json.dumps(rec)}")
            here = source_digest()
            if rec.get("sources") != here:
                problems.append(
                    f"the wheel was built from other sources than this tree's ({rec.get('sources')} != {here}; "
                    f"built from commit {rec.get('commit')}): run make wheel again"
                )
            head = _git("rev-parse", "HEAD")
            if head is not None:
                print(f"this tree: commit {head}{' (the same)' if head == rec.get('commit') else ''}")
            if "wheel" in rec:
                w = ROOT / "dist" / str(rec["wheel"])
                if not w.is_file():
                    problems.append(f"the stamped wheel {w.name} is not in dist/")
                elif file_digest(w) != rec.get("wheel_sha256"):
                    problems.append(f"dist/{w.name} is not the wheel stamped (its SHA-256 differs)")
    try:
        import offload_adam
        from offload_adam import _native

        where = offload_adam.__file__ or "?"
        print(f"offload_adam from {where}; extension {_native.__file__}, SIMD path {_native.simd_path()}")
        if site is not None and not os.path.realpath(where).startswith(os.path.realpath(site) + os.sep):
            problems.append(f"offload_adam is imported from {where}, not from the wheel installed under {site}")
    except Exception as e:
        problems.append(f"offload_adam does not import: {type(e).__name__}: {e}")
    if dry:
        print("dry run: no CUDA wanted (the CUDA check is skipped)")
    else:
        import torch

        if not torch.cuda.is_available():
            problems.append("CUDA is not available")
        else:
            print(f"CUDA device: {torch.cuda.get_device_name()}")
    for p in problems:
        print(f"PREFLIGHT FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stamp")
    s.add_argument("--out", type=Path, default=ROOT / "dist" / "offload_adam-commit.json")
    s.add_argument("--no-wheel", action="store_true", help="stamp the tree alone (a dry run)")
    c = sub.add_parser("check")
    c.add_argument("--stamp", type=Path, default=None)
    c.add_argument("--site", default=None, help="where the wheel was installed: offload_adam must be imported from there")
    c.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "stamp":
        return stamp(args.out, not args.no_wheel)
    return check(args.stamp, args.site, args.dry)


if __name__ == "__main__":
    sys.exit(main())
