"""``python -m offload_adam bench [...]``: the same-process benchmark (see ``bench.py``);
``python -m offload_adam plan [...]``: which configurations fit a machine (see ``plan.py``)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m offload_adam {bench,plan} [--help | options]")
        return 0 if argv else 2
    if argv[0] == "bench":
        from .tools.bench import main as bench

        return bench(argv[1:])
    if argv[0] == "plan":
        from .tools.plan import main as plan

        return plan(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m offload_adam bench --help, or plan --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
