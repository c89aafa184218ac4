"""`yaie plan`: how much memory a model's weights and KV cache take, and how many sequences fit.

Pure arithmetic over a model's config (a preset, a config.json, a HF folder or a GGUF file's
metadata); nothing is loaded onto a device.
"""

from yaie.plan.architecture import Architecture
from yaie.plan.memory import Overhead
from yaie.plan.planner import DEFAULT_CONTEXTS, Plan, make_plan
from yaie.plan.presets import PRESETS
from yaie.plan.sources import ModelSource, PlanError, load_model_source

__all__ = [
    "DEFAULT_CONTEXTS",
    "PRESETS",
    "Architecture",
    "ModelSource",
    "Overhead",
    "Plan",
    "PlanError",
    "load_model_source",
    "make_plan",
]
