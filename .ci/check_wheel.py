"""Checks the wheels in dist/: each is abi3 (one wheel for CPython >= 3.10) and tagged
manylinux2014 (glibc 2.17: RHEL/Rocky 8 and the clusters users train on), read from the wheel's
own WHEEL file, not its name. Exits non-zero naming the wheel and the tag it has."""

from __future__ import annotations

import glob
import sys
import zipfile


def tags(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]


def main() -> int:
    wheels = sorted(glob.glob("dist/offload_adam-*.whl"))
    if not wheels:
        print("check_wheel: no wheel in dist/ (run make wheel)", file=sys.stderr)
        return 1
    bad = 0
    for w in wheels:
        t = tags(w)
        ok = bool(t) and all(x.split("-")[1] == "abi3" for x in t) and any(
            x.endswith(("manylinux2014_x86_64", "manylinux2014_aarch64", "manylinux_2_17_x86_64", "manylinux_2_17_aarch64"))
            for x in t
        )
        print(f"{'ok ' if ok else 'BAD'} {w}: {', '.join(t) or 'no Tag in WHEEL'}")
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
