"""``python -m offload_adam COMMAND [options]``: the package's commands (``tools/``), each with
its own ``--help``."""

from __future__ import annotations

import importlib
import sys

# name -> (module under offload_adam.tools, one line on what it does)
COMMANDS = {
    "plan": ("plan", "what fits a machine, how fast it steps, what it costs the machine and what to write (--inference: tokens/s)"),
    "env": ("env", "this machine as a bug report needs it: SIMD path, I/O backend, torch and CUDA, memlock, pinned memory"),
    "calibrate": ("calibrate", "measures this machine's bandwidths and matmul rates for placement='auto' and plan"),
    "bench": ("bench", "the same-process benchmark against torch and the peers (--nvme, --weights, --fsdp2, ...)"),
    "bench-charts": ("bench_charts", "the charts of a bench run (PNGs) from the JSON bench --json wrote"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m offload_adam COMMAND [--help | options]",
        "",
        "commands:",
        *(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()),
        "",
        "example: python -m offload_adam plan --params 13B --gpu-gb 24 --host-gb 64 --nvme-gb 1000",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    tool = importlib.import_module(f".tools.{COMMANDS[argv[0]][0]}", __package__)
    return int(tool.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
