"""The tier controller: when pages move between GPU, host and L3 (see controller.controller)."""

from controller.controller import FAILED, LoadTicket, TierController, WritePolicy
from controller.cost import CostModel
from controller.l3_io import L3Worker
from controller.stats import CacheStats

__all__ = ["FAILED", "CacheStats", "CostModel", "L3Worker", "LoadTicket", "TierController", "WritePolicy"]
