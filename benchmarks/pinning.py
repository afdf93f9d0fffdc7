"""How fast pinned host memory is made: ``cudaHostAlloc`` (torch's default) against
``cudaHostRegister`` with pages mapped on threads (``pinned_use_cuda_host_register``, what
:func:`storm_compile.runtime.streams.pin_quickly` sets), each in fresh processes, alternated.

Each child pins :data:`BUFFERS` (the sizes of a streamed model's first step: a few large
buffers and many weight-sized ones), reports seconds and GB/s, then times a device-to-host copy
into the first buffer (pinning that runs fast but copies slowly would be no gain).

    python -m benchmarks.pinning --out DIR [--rounds 2]

Writes ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

from benchmarks.activation_memory import EXIT_NO_CUDA
from benchmarks.compile_time import cuda_missing
from storm_compile.runtime.streams import PINNING_THREADS

MIB = 1 << 20
BUFFERS = [256 * MIB] * 8 + [30 * MIB] * 40
"""3.17 GiB: eight activation-sized buffers and forty of a 3B model's weight gradients."""
COPIES = 5
"""Device-to-host copies timed into the first buffer."""
MODES = {"cudaHostAlloc": "pinned_use_cuda_host_register:False",
         "cudaHostRegister": f"pinned_use_cuda_host_register:True,"
                             f"pinned_num_register_threads:{PINNING_THREADS}"}
"""``PYTORCH_CUDA_ALLOC_CONF`` of each child."""


def child() -> dict:
    torch.empty(1, device="cuda")
    begin = time.perf_counter()
    buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in BUFFERS]
    pin_s = time.perf_counter() - begin
    source = torch.empty(BUFFERS[0], dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(COPIES):
        buffers[0].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - begin
    return {"pinned_bytes": sum(BUFFERS), "pin_s": pin_s, "pin_gbps": sum(BUFFERS) / pin_s / 1e9,
            "d2h_gbps": COPIES * BUFFERS[0] / copy_s / 1e9}


def _run_child(mode: str) -> dict:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": MODES[mode]}
    done = subprocess.run([sys.executable, "-m", "benchmarks.pinning", "--child"], env=env,
                          capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/pinning"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if cuda_missing("pinning", False):
        return EXIT_NO_CUDA
    if args.child:
        print(json.dumps(child()), flush=True)
        return 0
    rows = [_run_child(mode) for _ in range(args.rounds) for mode in MODES]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
        indent=1))
    table = tabulate(rows, headers="keys", tablefmt="github", floatfmt=".3g")
    (args.out / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
