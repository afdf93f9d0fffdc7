"""The same plan on every rank of a process group.

Ranks that plan a graph differently copy, recompute and free different tensors: their step
times and memory differ, and under FSDP2 their collectives may be issued in different orders.
Plans differ when their inputs do: ``profile="auto"`` or ``cost="measured"`` calibrated on each
rank's own GPU, different options, or different graphs. So every rank publishes a fingerprint
of each plan it makes (both rewritten graphs, with device indices left out) in the default
process group's store, under the plan's position in the process's sequence of storm plans, and
compares it with every other rank's: a difference, or a rank that never plans that graph, is a
:class:`StormRankMismatchError` on every rank that waits for it, before anything runs. The
GPU's calibration (``profile="auto"``) is made once, by rank 0, and shared
(:func:`from_rank_zero`), so that every rank plans with the same costs.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from storm_compile.fx.graphs import StormGraphs

AGREEMENT_TIMEOUT_S = 600
"""How long a rank waits for the other ranks' plan of the same graph. Ranks reach a graph's
plan at about the same time (they run the same program); the wait covers one rank compiling
the graphs before it (Inductor, several minutes on a large model) while another took them from
its cache."""

_DEVICE_INDEX = re.compile(r"device\(type='(\w+)', index=\d+\)")
_SEQUENCE = itertools.count()


class StormRankMismatchError(RuntimeError):
    """Ranks of one process group planned a graph differently, or not at all."""


def rank_key() -> int | None:
    """This process's rank in the default process group, when it has more than one; else None.
    Part of the plans' cache key, so that ranks sharing a cache directory each plan (and check)
    every graph themselves."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.get_rank()


def plan_fingerprint(graphs: "StormGraphs") -> str:
    """A digest of both rewritten graphs' code, the same on every rank for the same plan."""
    code = graphs.forward.code + graphs.backward.code
    return hashlib.sha256(_DEVICE_INDEX.sub(r"device(type='\1')", code).encode()).hexdigest()


def from_rank_zero(name: str, make: Callable[[], str],
                   timeout_s: float = AGREEMENT_TIMEOUT_S) -> str:
    """``make()`` as rank 0 of the default process group made it, shared with every other rank
    through the group's store (``make`` runs on rank 0 only); ``make()`` itself outside a group
    of several ranks."""
    rank = rank_key()
    if rank is None:
        return make()
    store, key = _store(), f"storm/shared/{name}"
    if rank == 0:
        store.set(key, make())
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # noqa: BLE001 - each backend's store raises its own timeout
        raise StormRankMismatchError(
            f"storm: rank {rank} waited {timeout_s:.0f} s for rank 0's {name}: ({error})"
        ) from error
    return store.get(key).decode()


def _store() -> dist.Store:
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise StormRankMismatchError(
            "storm cannot check that the ranks agree on their plans: this torch has no "
            "torch.distributed.distributed_c10d._get_default_store")
    return get_store()


def check_ranks_agree(graphs: "StormGraphs", timeout_s: float = AGREEMENT_TIMEOUT_S) -> None:
    """Raise :class:`StormRankMismatchError` unless every rank of the default process group
    made the same plan for this, the process's next, storm graph. Does nothing outside a
    process group of several ranks."""
    rank = rank_key()
    if rank is None:
        return
    sequence = next(_SEQUENCE)
    store, world = _store(), dist.get_world_size()
    keys = [f"storm/plan/{sequence}/{r}" for r in range(world)]
    store.set(keys[rank], plan_fingerprint(graphs))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # noqa: BLE001 - each backend's store raises its own timeout
        raise StormRankMismatchError(
            f"storm: rank {rank} planned its graph number {sequence} and waited "
            f"{timeout_s:.0f} s for the other ranks' plan of it ({error}); the ranks compile "
            f"different graphs (different models, inputs or graph breaks)") from error
    prints = [store.get(key).decode() for key in keys]
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise StormRankMismatchError(
            f"storm: ranks {differ} planned graph number {sequence} differently from rank 0, "
            f"so the ranks would move and free different tensors. Give every rank the same "
            f"options and the same cost profile (a named profile or a profile file rather "
            f"than 'auto' or cost='measured', which calibrate on each rank's own GPU)")
