"""Where AdamW runs for parameters kept in host memory: on the host, or on the GPU with its state
streamed through, measured on the same parameters in one run.

* ``host``: fused AdamW on the CPU over the pinned parameter, gradient and moments (what
  ``torch.optim.AdamW(fused=True)`` does for a model streamed with ``stream_parameters``).
* ``streamed``: chunk by chunk (``--chunk-mib`` of parameters), the parameter, gradient and
  both moments are copied to the GPU on an H2D stream, fused AdamW runs there, and the
  parameter and moments go back on a D2H stream; two chunks are in flight, so one chunk's
  copies overlap the other's update and copies.

Both start from the same values and take ``--steps`` steps. The table gives the median seconds
per step, parameters per second, bytes over the link per step, and the largest difference
between the two methods' parameters after the steps (they must agree to rounding).

    python -m benchmarks.optimizer --params 1.2e9 --out DIR
    python -m benchmarks.optimizer --smoke --out DIR      # CPU: the harness itself
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch.optim.adamw import adamw

from benchmarks.activation_memory import EXIT_NO_CUDA
from benchmarks.compile_time import cuda_missing, write
from storm_compile.fx.vocabulary import MIB, MS

LEARNING_RATE, BETAS, WEIGHT_DECAY, EPS = 3e-4, (0.9, 0.95), 0.1, 1e-8
"""The usual AdamW settings of language-model training."""
COPIED_IN = 4
"""Tensors the streamed update copies to the GPU per parameter: itself, its gradient, both
moments."""
COPIED_OUT = 3
"""Tensors it copies back: the parameter and both moments (the gradient is not changed)."""
IN_FLIGHT = 2
"""Chunks the streamed update keeps in flight: one's copies overlap the other's work."""
SMOKE_PARAMS = 1 << 16
SMOKE_CHUNK_MIB = 0.0625


@dataclasses.dataclass
class _State:
    """A flat parameter with its gradient and AdamW moments, in host memory."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def _state(numel: int, dtype: torch.dtype, pin: bool) -> _State:
    generator = torch.Generator().manual_seed(0)

    def host(values: torch.Tensor) -> torch.Tensor:
        values = values.to(dtype)
        return values.pin_memory() if pin else values

    return _State(host(torch.randn(numel, generator=generator)),
                  host(torch.randn(numel, generator=generator) * 1e-2),
                  host(torch.zeros(numel)), host(torch.zeros(numel)))


def _update(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False,
          beta1=BETAS[0], beta2=BETAS[1], lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=EPS,
          maximize=False)


class _Host:
    """Fused AdamW on the CPU, in place on the host state."""

    def __init__(self, state: _State) -> None:
        self.state, self.step_count = state, torch.zeros(())

    def step(self) -> None:
        s = self.state
        _update([s.param], [s.grad], [s.exp_avg], [s.exp_avg_sq], [self.step_count])


class _Streamed:
    """Fused AdamW on ``device``, the host state copied through chunk by chunk."""

    def __init__(self, state: _State, device: torch.device, chunk: int) -> None:
        self.state, self.device, self.chunk = state, device, chunk
        numel = state.param.numel()
        self.bounds = [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)]
        self.steps = [torch.zeros((), device=device) for _ in self.bounds]
        self.buffers = [[torch.empty(chunk, dtype=state.param.dtype, device=device)
                         for _ in range(COPIED_IN)] for _ in range(IN_FLIGHT)]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.freed = [torch.cuda.Event() for _ in range(IN_FLIGHT)]

    def step(self) -> None:
        s, compute = self.state, torch.cuda.current_stream(self.device) if self.cuda else None
        host = (s.param, s.grad, s.exp_avg, s.exp_avg_sq)
        for index, (lo, hi) in enumerate(self.bounds):
            slot = index % IN_FLIGHT
            p, g, m, v = (b[:hi - lo] for b in self.buffers[slot])
            with self._on(self.h2d if self.cuda else None):
                if self.cuda and index >= IN_FLIGHT:
                    self.h2d.wait_event(self.freed[slot])
                for dst, src in zip((p, g, m, v), host):
                    dst.copy_(src[lo:hi], non_blocking=True)
            if self.cuda:
                compute.wait_stream(self.h2d)
            _update([p], [g], [m], [v], [self.steps[index]])
            with self._on(self.d2h if self.cuda else None):
                if self.cuda:
                    self.d2h.wait_stream(compute)
                for src, dst in zip((p, m, v), (s.param, s.exp_avg, s.exp_avg_sq)):
                    dst[lo:hi].copy_(src, non_blocking=True)
                if self.cuda:
                    self.freed[slot].record(self.d2h)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _time(method, steps: int) -> float:
    seconds = []
    for _ in range(steps):
        begin = time.perf_counter()
        method.step()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1.2e9,
                        help="parameters updated per step (default: the 3B preset cut to 8 "
                             "layers, 1.2e9)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="of the parameters and their AdamW state, as torch keeps it")
    parser.add_argument("--chunk-mib", type=float, default=64.0,
                        help="parameter bytes per chunk of the streamed update")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU run of the harness")
    parser.add_argument("--out", type=Path, default=Path("bench-out/optimizer"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    cuda = not args.smoke
    if cuda_missing("optimizer", args.smoke):
        return EXIT_NO_CUDA
    numel = SMOKE_PARAMS if args.smoke else int(args.params)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    chunk = int((SMOKE_CHUNK_MIB if args.smoke else args.chunk_mib) * MIB) // itemsize
    device = torch.device("cuda" if cuda else "cpu")
    host_state, streamed_state = _state(numel, dtype, cuda), _state(numel, dtype, cuda)
    methods = {"host": _Host(host_state), "streamed": _Streamed(streamed_state, device, chunk)}
    rows = []
    for name, method in methods.items():
        seconds = _time(method, args.steps)
        link = 0 if name == "host" else (COPIED_IN + COPIED_OUT) * numel * itemsize
        rows.append({"method": name, "step_ms": seconds * MS, "params_per_s": numel / seconds,
                     "link_gb_per_step": link / 1e9})
        print(rows[-1], flush=True)
    gap = (host_state.param.float() - streamed_state.param.float()).abs().max().item()
    results = {"environment": {"torch": torch.__version__, "python": platform.python_version(),
                               "device": torch.cuda.get_device_name() if cuda
                               else platform.processor(),
                               "threads": torch.get_num_threads()},
               "params": numel, "dtype": args.dtype, "chunk_params": chunk, "steps": args.steps,
               "max_param_diff": gap, "rows": rows}
    table = tabulate([[r["method"], f"{r['step_ms']:.1f}", f"{r['params_per_s'] / 1e9:.2f}",
                       f"{r['link_gb_per_step']:.1f}"] for r in rows],
                     headers=["method", "step ms", "G params/s", "link GB/step"])
    table += f"\n\nlargest parameter difference after {args.steps} steps: {gap:.3g}\n"
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out, results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
