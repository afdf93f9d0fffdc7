"""Graph passes of storm-compile, run in order by :mod:`storm_compile.compiler.pipeline`: the
joint-graph passes (``refetch_weights``, ``sum_tied_gradients``) before the split, then the passes
on the forward and backward pair."""

from storm_compile.passes.annotate_costs import annotate_costs
from storm_compile.passes.insert_transfers import insert_transfers
from storm_compile.passes.place_transfers import place_transfers
from storm_compile.passes.plan_memory import plan_memory
from storm_compile.passes.plan_gradient_sums import plan_gradient_sums
from storm_compile.passes.plan_offload import plan_offload
from storm_compile.passes.plan_weights import plan_weights
from storm_compile.passes.refetch_weights import refetch_weights
from storm_compile.passes.rematerialize import rematerialize
from storm_compile.passes.sum_tied_gradients import sum_tied_gradients
from storm_compile.passes.verify import StormVerificationError, verify_graphs, verify_joint
from storm_compile.planner.step_budget import StormBudgetError

__all__ = ["refetch_weights", "sum_tied_gradients", "annotate_costs", "plan_offload",
           "plan_memory", "rematerialize", "plan_weights", "place_transfers", "insert_transfers",
           "plan_gradient_sums", "verify_graphs", "verify_joint", "StormBudgetError",
           "StormVerificationError"]
