"""Planning time of storm's passes on a large model, traced with fake tensors on the CPU.

``python -m benchmarks.planning_time [--layers 32] [--memory-budget 0.5]`` traces the built-in
gpt (benchmark shape d2048/T2048/B4, bf16) and prints the seconds each pass took, as the pipeline
logs them: the partitioner's splits (``split``, and ``rematerialize``'s re-split) are torch's
min-cut; the planner is ``plan_offload`` + ``plan_memory``; placement is ``schedule_transfers``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import re

from storm_compile import cli

PASS_RE = re.compile(r"storm: pass (\w+) took ([0-9.]+) s")
PLANNER_PASSES = ("plan_offload", "plan_memory")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def emit(self, record: logging.LogRecord) -> None:
        match = PASS_RE.match(record.getMessage())
        if match:
            self.seconds[match.group(1)] += float(match.group(2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--memory-budget", default="0.5")
    parser.add_argument("--profile", default=cli.DEFAULT_PROFILE)
    options = parser.parse_args(argv)
    args = cli._parser().parse_args(
        ["schedule", "gpt", "--layers", str(options.layers), "--d-model", "2048", "--heads",
         "16", "--seq", "2048", "--batch", "4", "--dtype", "bfloat16",
         "--profile", options.profile, "--memory-budget", options.memory_budget])
    logger = logging.getLogger("storm_compile")
    handler, level = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        ctx = cli._context(args, memory_budget=cli._budget(options.memory_budget))
        cli._trace(args, ctx)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    for name, seconds in handler.seconds.items():
        print(f"{name:20s} {seconds:7.3f} s")
    planner = sum(handler.seconds[p] for p in PLANNER_PASSES)
    print(f"{'planner total':20s} {planner:7.3f} s  ({' + '.join(PLANNER_PASSES)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
