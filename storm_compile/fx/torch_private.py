"""Every private torch API storm uses, in one place, each found by feature detection.

A private name may move or change between torch releases; storm is tested on the releases in
:data:`TESTED_TORCH`. Each name below is looked up on first use (``from
storm_compile.fx.torch_private import compile_fx`` imports Inductor then, not when this module is
imported, so ``storm --help`` and the CLI's planning pay only for what they use), trying its
places in order: a name this torch has in none of them raises :class:`StormTorchVersionError`
naming the API, the installed torch and the tested releases. The optional names of
:data:`OPTIONAL` are read at each call instead, through :func:`optional`, and are None where
this torch lacks them: storm then does without what they give (see each entry).

No other module of storm imports a private torch module or reads a private torch attribute
(``tests/test_layout.py`` checks).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

TESTED_TORCH = ("2.11", "2.13")
"""The torch releases storm's tests run on: 2.11 on the GPU host, 2.13 in CI."""

APIS: dict[str, tuple[str, ...]] = {
    # FX, pytrees, dispatch: the graphs storm reads and rewrites.
    "tree_leaves": ("torch.utils._pytree:tree_leaves",),
    "OpOverload": ("torch._ops:OpOverload",),
    "HigherOrderOperator": ("torch._ops:HigherOrderOperator",),
    "LazyGraphModule": ("torch.fx._lazy_graph_module:_LazyGraphModule",),
    "use_lazy_graph_module": ("torch.fx._lazy_graph_module:_use_lazy_graph_module",),
    "is_in_torch_dispatch_mode": ("torch.utils._python_dispatch:is_in_torch_dispatch_mode",),
    "DisableTorchFunctionSubclass": ("torch._C:DisableTorchFunctionSubclass",),
    "foreach_mul_": ("torch:_foreach_mul_",),
    # AOTAutograd, its partitioner and fake tensors: capture and the split.
    "functorch_config": ("torch._functorch.config:",),
    "min_cut_rematerialization_partition": (
        "torch._functorch.partitioners:min_cut_rematerialization_partition",),
    "SavedForBackwardsAOTOutput": (
        "torch._functorch._aot_autograd.descriptors:SavedForBackwardsAOTOutput",),
    "aot_module_simplified": ("torch._functorch.aot_autograd:aot_module_simplified",),
    "FakeTensorMode": ("torch._subclasses.fake_tensor:FakeTensorMode",),
    "FakeTensor": ("torch._subclasses.fake_tensor:FakeTensor",),
    "DataDependentOutputException": (
        "torch._subclasses.fake_tensor:DataDependentOutputException",),
    "DynamicOutputShapeException": (
        "torch._subclasses.fake_tensor:DynamicOutputShapeException",),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor:unset_fake_temporarily",),
    "CompileContext": ("torch._guards:CompileContext",),
    "TracingContext": ("torch._guards:TracingContext",),
    "tracing": ("torch._guards:tracing",),
    # Dynamo's backend helpers and Inductor: the backend and the compile.
    "aot_autograd": ("torch._dynamo.backends.common:aot_autograd",),
    "boxed_nop": ("torch._dynamo.backends.debugging:boxed_nop",),
    "compile_fx": ("torch._inductor.compile_fx:compile_fx",),
    "compile_fx_inner": ("torch._inductor.compile_fx:compile_fx_inner",),
    "joint_graph_passes": ("torch._inductor.fx_passes.joint_graph:joint_graph_passes",),
    "CustomPartitionerFn": ("torch._inductor.custom_graph_pass:CustomPartitionerFn",),
    "get_hash_for_files": ("torch._inductor.custom_graph_pass:get_hash_for_files",),
    "select_decomp_table": ("torch._inductor.decomposition:select_decomp_table",),
    "inductor_lowering": ("torch._inductor.lowering:",),
    "inductor_config": ("torch._inductor.config:",),
    "list_mode_options": ("torch._inductor:list_mode_options",),
    "inductor_cache_dir": ("torch._inductor.runtime.cache_dir_utils:cache_dir",),
    # The autograd engine and storages: the runtime of streamed weights and offloads.
    "storage_use_count": ("torch._C:_storage_Use_Count",),
    "will_engine_execute_node": ("torch._C:_will_engine_execute_node",),
    "execution_engine": ("torch.autograd:Variable._execution_engine",),
}
"""Each private API storm uses: its name here, and its places as ``"module:attribute.path"``
(an empty path is the module itself), the first this torch has winning."""

OPTIONAL: dict[str, tuple[str, ...]] = {
    "current_graph_task_id": ("torch._C:_current_graph_task_id",),
    "set_allocator_settings": ("torch._C:_accelerator_setAllocatorSettings",
                               "torch._C:_cuda_cudaCachingAllocator_set_allocator_settings"),
    "layout_constraint_tag": ("torch._library.utils:get_layout_constraint_tag",),
    "tag_to_layout_constraint": ("torch._inductor.lowering:tag_to_layout_constraint",),
}
"""Private APIs storm can do without: the running backward's id (without it a streamed
parameter's gradient read cannot tell a backward in progress from none, and waits as outside
one), the caching allocator's settings (without them storm pins as torch does by default), and
the layout constraint Inductor gives a custom op (without it storm leaves its ops' lowering to
Inductor's implicit fallback, which gives the same, more slowly)."""


class StormTorchVersionError(ImportError):
    """The installed torch lacks a private API storm needs."""


def _lookup(place: str) -> Any:
    module, _, path = place.partition(":")
    value: Any = importlib.import_module(module)
    for attribute in filter(None, path.split(".")):
        value = getattr(value, attribute)
    return value


def _first(places: tuple[str, ...]) -> tuple[bool, Any]:
    for place in places:
        try:
            return True, _lookup(place)
        except (ImportError, AttributeError):
            continue
    return False, None


def optional(name: str) -> Any:
    """The optional API ``name`` of :data:`OPTIONAL` as this torch has it now, or None."""
    return _first(OPTIONAL[name])[1]


def __getattr__(name: str) -> Any:
    if name not in APIS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found, value = _first(APIS[name])
    if not found:
        raise StormTorchVersionError(
            f"storm needs torch's private {' or '.join(APIS[name])}, which torch "
            f"{torch.__version__} does not have; storm is tested on torch "
            f"{' and '.join(TESTED_TORCH)}")
    globals()[name] = value
    return value
