"""How the host work of streamed training scales with threads: a copy (the host's memory
bandwidth), a gradient added into ``.grad`` and one fused AdamW step, each on
``--bytes`` of bf16, timed on a thread as storm's host thread runs them, for each intra-op
thread count in ``--threads``. The rates are bytes of the parameter per second (a copy and an
addition also read their source; AdamW reads and writes the parameter, gradient and both
moments).

    python -m benchmarks.host_threads --out DIR [--threads 1,2,4,8,16] [--bytes 268435456]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from benchmarks.compile_time import write
from storm_compile.cost.calibrate import seconds_on_a_thread
from storm_compile.fx.vocabulary import GB

DTYPE = torch.bfloat16
"""The dtype of the streamed models' weights and gradients."""
REPEATS = 5
DEFAULT_BYTES = 256 << 20
"""Far above the last-level cache of a server CPU (tens of MiB), so the rates are memory's."""


def rates(nbytes: int, threads: int) -> dict[str, float]:
    """GB/s of a copy, an addition and a fused AdamW step of ``nbytes`` on ``threads``
    intra-op threads."""
    elements = nbytes // DTYPE.itemsize
    pin = torch.cuda.is_available()
    param = torch.nn.Parameter(torch.zeros(elements, dtype=DTYPE, pin_memory=pin))
    param.grad = torch.zeros_like(param)
    arrived = torch.ones(elements, dtype=DTYPE, pin_memory=pin)
    target = torch.empty_like(arrived)
    optimizer = torch.optim.AdamW([param], fused=True)
    optimizer.step()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = {"copy": seconds_on_a_thread(lambda: target.copy_(arrived), REPEATS),
                   "add": seconds_on_a_thread(lambda: param.grad.add_(arrived), REPEATS),
                   "adamw": seconds_on_a_thread(optimizer.step, REPEATS)}
    finally:
        torch.set_num_threads(before)
    return {name: nbytes / s / GB for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES)
    parser.add_argument("--out", type=Path, default=Path("bench-out/host_threads"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for threads in (int(t) for t in args.threads.split(",") if t):
        rows.append({"threads": threads, **rates(args.bytes, threads)})
        print(rows[-1], flush=True)
    results = {"host": platform.node(), "cpus": os.cpu_count(),
               "default_threads": torch.get_num_threads(), "bytes": args.bytes, "rows": rows}
    table = tabulate([[r["threads"], f"{r['copy']:.1f}", f"{r['add']:.1f}", f"{r['adamw']:.1f}"]
                      for r in rows],
                     headers=["threads", "copy GB/s", "add GB/s", "AdamW GB/s"],
                     tablefmt="github")
    write(args.out, results, f"{os.cpu_count()} CPUs, torch's default "
                             f"{torch.get_num_threads()} threads\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
