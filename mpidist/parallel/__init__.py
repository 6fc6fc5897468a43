"""Parallel training wrappers built on mpidist.collectives and mpidist.nn."""

from ..comm.mesh import DeviceMesh, mesh
from .ddp import DDP
from .fsdp import FSDP, ShardingStrategy
from .full_state import full_optimizer_state_dict, full_state_dict, iter_full_state, load_full_state_dict
from .interface import LocalModule, PlacedParameter, Wrapper, as_wrapper
from .pipeline import Pipeline
from .zero import ZeroRedundancyOptimizer

__all__ = ["DDP", "FSDP", "ShardingStrategy", "Pipeline", "DeviceMesh", "mesh", "Wrapper",
           "PlacedParameter", "LocalModule", "as_wrapper", "full_state_dict", "iter_full_state",
           "load_full_state_dict", "full_optimizer_state_dict", "ZeroRedundancyOptimizer"]
