"""Every rank of a process group makes the same plan, or every rank fails loudly; DDP and FSDP2
train under storm with a memory budget as they do without it. Two ranks under
torch.multiprocessing: on the CPU (gloo), and, marked ``multi_gpu``, on two GPUs (NCCL)."""

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from helpers import CPU_TEST_OPTIONS
from storm_compile.cli.models import Block, GPTShape, build_gpt
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.fx.plan import Action
from storm_compile.runtime import ranks

WORLD = 2
SHAPE = GPTShape(d_model=128, layers=6, heads=4, seq=32, batch=2, dtype="float32")
DDP_BUCKET_MB = 1
"""About one block's parameters (DDPOptimizer's first bucket is 1 MB, and no bucket may be
smaller): the model splits into several pieces, each planned by storm."""
BUDGETED = {"offload": "hidden", "memory_budget": 0.5, "min_offload_bytes": 0}
CPU_BUDGETED = {**CPU_TEST_OPTIONS, **BUDGETED}
MISSING_TIMEOUT_S = 2.0
"""Rank 0's wait for a plan rank 1 never makes: short, the test only needs the error."""


def _graphs(code: str) -> SimpleNamespace:
    return SimpleNamespace(forward=SimpleNamespace(code=code), backward=SimpleNamespace(code=""))


def test_fingerprint_ignores_the_device_index_only():
    on = "y = storm.prefetch(x, device(type='cuda', index={}))"
    assert ranks.plan_fingerprint(_graphs(on.format(0))) == \
        ranks.plan_fingerprint(_graphs(on.format(1)))
    assert ranks.plan_fingerprint(_graphs(on.format(0))) != \
        ranks.plan_fingerprint(_graphs(on.replace("prefetch", "offload").format(0)))


def test_single_process_checks_nothing_and_shares_its_own():
    assert ranks.rank_key() is None
    ranks.check_ranks_agree(_graphs("anything"))
    assert ranks.from_rank_zero("value", lambda: "mine") == "mine"


def _outcome(action) -> str:
    try:
        action()
    except ranks.StormRankMismatchError as error:
        return f"mismatch: {error}"
    return "ok"


def _fingerprints(rank: int) -> dict:
    return {
        "agree": _outcome(lambda: ranks.check_ranks_agree(_graphs("same"))),
        "differ": _outcome(lambda: ranks.check_ranks_agree(_graphs(f"rank {min(rank, 1)}"))),
        "shared": ranks.from_rank_zero("test value", lambda: f"made by rank {rank}"),
        "missing": _outcome(lambda: ranks.check_ranks_agree(_graphs("x"), MISSING_TIMEOUT_S))
        if rank == 0 else "skipped",
    }


def _moved(planned: list) -> int:
    """Storages the plans offload or recompute."""
    return sum(len(g.storages.with_action(Action.OFFLOAD)) + len(g.plan.recompute)
               for g in planned)


def _largest_difference(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Largest difference of any gradient from its reference, relative to the reference's
    largest entry."""
    return max(((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
               for ours, theirs in pairs)


def _options(device: str, budget: float) -> dict:
    return {**(CPU_BUDGETED if device == "cpu" else BUDGETED), "memory_budget": budget}


def _ddp(rank: int, device: str, budget: float, python_reducer: bool = False) -> dict:
    """DDP under DDPOptimizer's per-bucket split, or, with ``python_reducer``, compiled whole
    with its gradient reduction traced by compiled autograd."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, device)
    reference = DistributedDataParallel(build_gpt(SHAPE, device)[0],
                                        bucket_cap_mb=DDP_BUCKET_MB)
    reference.module.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
    x = x + rank     # each rank its own batch: DDP averages different gradients
    planned = []
    backend = StormBackend(StormConfig.from_options(**_options(device, budget)),
                           observer=planned.append)
    compiled = torch.compile(ddp, backend=backend)
    modes = {"optimize_ddp": "python_reducer", "compiled_autograd": True} \
        if python_reducer else {}
    try:
        with torch._dynamo.config.patch(**modes):
            compiled(x).sum().backward()
    except Exception as error:  # noqa: BLE001 - dynamo wraps the backend's error
        cause = getattr(error, "inner_exception", error)
        return {"error": type(cause).__name__}
    reference(x).sum().backward()
    return {"graphs": len(planned), "moved": _moved(planned),
            "max_grad_rel_diff": _largest_difference(
                [(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                  reference.module.parameters())])}


def _fsdp2(rank: int, device: str, per_block: bool) -> dict:
    """FSDP2 the two ways people compile with it: each block compiled before ``fully_shard``
    (torchtitan's way), or the whole sharded model compiled."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, device)
    reference, _ = build_gpt(SHAPE, device)
    reference.load_state_dict(model.state_dict())
    planned = []
    backend = StormBackend(StormConfig.from_options(**_options(device, 0.5)),
                           observer=planned.append)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks if per_block else ():
        block.compile(backend=backend)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    run = model if per_block else torch.compile(model, backend=backend)
    x = x + rank
    run(x).sum().backward()
    reference(x).sum().backward()
    for param in reference.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return {"graphs": len(planned), "moved": _moved(planned),
            "max_grad_rel_diff": _largest_difference(
                [(a.grad.full_tensor(), b.grad) for a, b in zip(model.parameters(),
                                                                reference.parameters())])}


def _worker(rank: int, port: int, out: str, case: str, cuda: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    try:
        if case == "fingerprints":
            result = _fingerprints(rank)
        elif case.startswith("fsdp2"):
            result = _fsdp2(rank, device, per_block=case == "fsdp2-blocks")
        elif case == "python-reducer":
            result = _ddp(rank, device, 0.5, python_reducer=True)
        else:
            budget = {"same": 0.5, "different": 0.5 if rank == 0 else 0.25}[case]
            result = _ddp(rank, device, budget)
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(case: str, tmp_path: Path, cuda: bool = False) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path), case, cuda), nprocs=WORLD)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]


def test_ranks_compare_their_fingerprints(tmp_path):
    first, second = _run("fingerprints", tmp_path)
    assert first["agree"] == second["agree"] == "ok"
    assert first["differ"].startswith("mismatch: storm: ranks [1]")
    assert second["differ"].startswith("mismatch: storm: ranks [1]")
    assert "waited 2 s" in first["missing"]
    assert first["shared"] == second["shared"] == "made by rank 0"


ON_GPUS = [pytest.param(False, id="cpu"),
           pytest.param(True, id="cuda", marks=[pytest.mark.gpu, pytest.mark.multi_gpu])]
GRAD_TOLERANCE = 1e-4
"""Relative to each gradient's largest entry. fp32 on both sides; the compiled and eager graphs
order reductions differently, and on the GPU cuBLAS picks its algorithm per layout."""


@pytest.mark.parametrize("cuda", ON_GPUS)
@pytest.mark.parametrize("case", ["same", "python-reducer"])
def test_ddp_with_a_budget_trains_like_eager_ddp_on_every_rank(tmp_path, case, cuda):
    results = _run(case, tmp_path, cuda)
    for result in results:
        assert result.get("moved"), result
        assert result["max_grad_rel_diff"] < GRAD_TOLERANCE, result
    if case == "same":
        assert all(r["graphs"] > 2 for r in results), "DDPOptimizer did not split the model"


@pytest.mark.parametrize("cuda", ON_GPUS)
def test_ranks_with_different_budgets_fail_loudly(tmp_path, cuda):
    assert _run("different", tmp_path, cuda) == [{"error": "StormRankMismatchError"}] * WORLD


@pytest.mark.parametrize("cuda", ON_GPUS)
@pytest.mark.parametrize("case", ["fsdp2-whole", "fsdp2-blocks"])
def test_fsdp2_with_a_budget_trains_like_eager_on_every_rank(tmp_path, case, cuda):
    for result in _run(case, tmp_path, cuda):
        assert result["graphs"] and result["moved"], result
        assert result["max_grad_rel_diff"] < GRAD_TOLERANCE, result
