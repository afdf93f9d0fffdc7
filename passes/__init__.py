"""Graph passes of storm-compile, run in order by :func:`storm_compile.pipeline.run_passes`."""

from storm_compile.passes.annotate_costs import annotate_costs
from storm_compile.passes.insert_transfers import insert_transfers
from storm_compile.passes.plan_memory import plan_memory
from storm_compile.passes.place_transfers import place_transfers
from storm_compile.passes.plan_offload import plan_offload
from storm_compile.passes.plan_weights import plan_weights
from storm_compile.passes.rematerialize import rematerialize
from storm_compile.passes.verify import StormVerificationError, verify_graphs
from storm_compile.step_budget import StormBudgetError

__all__ = ["annotate_costs", "plan_offload", "plan_memory", "rematerialize", "plan_weights",
           "place_transfers", "insert_transfers", "verify_graphs", "StormBudgetError",
           "StormVerificationError"]
