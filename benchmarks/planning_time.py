"""Planning time of storm's passes on a large model, traced with fake tensors on the CPU.

``python -m benchmarks.planning_time [--layers 32] [--memory-budget 0.5]`` traces the built-in
gpt (its default shape, the benchmark's d2048/T2048/B4, bf16, with ``--layers`` blocks) as
``storm schedule`` does and prints the seconds each pass took, summed over its runs from the
pass records on the graphs: the partitioner's split (``split``) is torch's min-cut;
``rematerialize`` rebuilds recomputed values on it; the planner is ``plan_offload`` +
``plan_memory`` + ``plan_weights``; placement is ``place_transfers``.
"""

from __future__ import annotations

import argparse
import collections

from storm_compile.cli import commands
from storm_compile.config import DEFAULT_PROFILE
from storm_compile.fx.graphs import StormGraphs

PLANNER_PASSES = ("plan_offload", "plan_memory", "plan_weights")


def pass_seconds(graphs: StormGraphs) -> dict[str, float]:
    """Seconds per pass name, summed over every run of it on ``graphs`` (and on the split they
    replaced), in the order the passes first ran."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for record in graphs.records:
        seconds[record.name] += record.seconds
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--memory-budget", default="0.5")
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    options = parser.parse_args(argv)
    ctx = commands.planning_context(profile=options.profile, memory_budget=options.memory_budget)
    seconds = pass_seconds(commands.plan_model("gpt", ctx, layers=options.layers))
    for name, total in seconds.items():
        print(f"{name:20s} {total:7.3f} s")
    planner = sum(seconds[p] for p in PLANNER_PASSES)
    print(f"{'planner total':20s} {planner:7.3f} s  ({' + '.join(PLANNER_PASSES)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
