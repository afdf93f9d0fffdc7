"""Graph passes of storm-compile, run in order by :func:`storm_compile.pipeline.run_passes`."""

from storm_compile.passes.annotate_costs import annotate_costs
from storm_compile.passes.insert_transfers import insert_transfers
from storm_compile.passes.plan_memory import StormBudgetError, plan_memory
from storm_compile.passes.plan_offload import plan_offload
from storm_compile.passes.rematerialize import rematerialize
from storm_compile.passes.schedule_transfers import schedule_transfers
from storm_compile.passes.verify import StormVerificationError, verify_graphs

__all__ = ["annotate_costs", "plan_offload", "plan_memory", "rematerialize",
           "schedule_transfers", "insert_transfers", "verify_graphs", "StormBudgetError",
           "StormVerificationError"]
