"""``storm``: command-line entry point.

``storm schedule MODEL`` traces MODEL's forward and backward with fake tensors (no real compute,
no GPU, any size), runs storm's passes with a device profile, and prints the predicted step and
memory with storm against without, and what happened to each activation saved for the backward
(kept, offloaded or recomputed, and why); ``--nodes`` prints both rewritten graphs in execution
order instead: streams, events, predicted compute and transfer times and device memory;
``--timings`` adds each pass run: its seconds and what it changed. The tensors live on the CPU
while tracing, so activations are planned as they would be on the profile's GPU: ``--profile``
is resolved as the backend resolves its ``profile`` option, except that ``auto`` without a CUDA
device plans for the h100.

``storm pareto MODEL`` plans the same model under a sweep of memory budgets and prints the
predicted frontier: budget → step time, peak, bytes offloaded and recomputed; budgets below the
model's minimum are skipped with a note on stderr.

``storm calibrate`` measures the present GPU into a profile JSON.

The parser (:mod:`storm_compile.cli.arguments`) imports no torch, so ``storm --help``,
``storm --version`` and usage errors print at once; :func:`main` imports the commands
(:mod:`storm_compile.cli.commands`), and with them torch, once the command line has parsed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from storm_compile.cli.arguments import EXIT_USAGE, build_parser

EXIT_BROKEN_PIPE = 141
"""Exit status after the reader of standard output went away: 128 + SIGPIPE, as a shell
reports a command a closed pipe stopped."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` gives (the process's arguments by default) and return its exit
    status; bad input is one line on stderr and :data:`EXIT_USAGE`."""
    args = build_parser().parse_args(argv)
    from storm_compile.cli import commands  # torch, only for a command that runs

    try:
        return commands.COMMANDS[args.command](args)
    except commands.USER_ERRORS as error:
        print(f"storm: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader closed standard output (``storm schedule gpt --nodes | head``): stop
        # quietly, as Unix tools do; stdout goes to the null device so that Python's flush at
        # exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
