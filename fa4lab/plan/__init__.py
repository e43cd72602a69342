"""The FA4 planner: tiles, MMAs, TMEM, SMEM, warp roles and the barrier graph, computed once.

    from fa4lab.plan import plan_forward
    plan = plan_forward(spec, arch="sm100")   # or "sm90"; overrides: n_block=..., kv_stage=...

`fa4lab.plan.simulate.simulate(plan)` runs the roles' programs against the barrier graph
(timeline, deadlocks, hazards) and `fa4lab.plan.throughput.predict(plan)` the throughput;
`fa4lab plan` prints the report. `plan_backward(spec)` is the B200 backward's plan
(`fa4lab.plan.backward`, `fa4lab plan --backward`).
"""

from fa4lab.plan.backward import BackwardPlan, plan_backward
from fa4lab.plan.barriers import Barrier, BarrierGraph
from fa4lab.plan.costs import DEFAULT_COSTS, CostModel
from fa4lab.plan.forward import OVERRIDES, plan_forward
from fa4lab.plan.plan import Plan
from fa4lab.plan.roles import Role
from fa4lab.plan.smem import SmemPlan, SmemRegion
from fa4lab.plan.tiles import MmaPlan, Tiles
from fa4lab.plan.tmem import TmemPlan, TmemRegion

__all__ = [
    "DEFAULT_COSTS", "OVERRIDES", "BackwardPlan", "Barrier", "BarrierGraph", "CostModel",
    "MmaPlan", "Plan", "Role", "SmemPlan", "SmemRegion", "Tiles", "TmemPlan", "TmemRegion",
    "plan_backward", "plan_forward",
]
