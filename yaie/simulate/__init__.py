"""`yaie simulate`: the engine's scheduler, block pool and radix cache run in virtual time against a
step-time cost model, over synthetic or traced traffic. No torch and no weights: importing this
package must not import torch (a test checks it).
"""

from yaie.engine.step_shape import StepShape
from yaie.simulate.cost_model import CostModel, ServedLevel
from yaie.simulate.report import plot, summarize
from yaie.simulate.simulator import EngineSettings, Scenario, SimulationError, SimulationResult, simulate
from yaie.simulate.traffic import Request, Traffic, TrafficSpec, Turn, load_trace, synthetic_traffic

__all__ = [
    "CostModel",
    "EngineSettings",
    "Request",
    "Scenario",
    "ServedLevel",
    "SimulationError",
    "SimulationResult",
    "StepShape",
    "Traffic",
    "TrafficSpec",
    "Turn",
    "load_trace",
    "plot",
    "simulate",
    "summarize",
    "synthetic_traffic",
]
