"""The tier controller: when pages move between GPU, host and L3 (see controller.controller)."""

from controller.controller import TierController
from controller.cost import CostModel
from controller.policy import WritePolicy
from controller.stats import CacheStats
from controller.ticket import LoadTicket, PrefetchHold
from controller.transfers import FAILED, PREFETCHED, DiskLoad, Transfers
from tiers.l3.worker import L3Worker

__all__ = [
    "FAILED",
    "PREFETCHED",
    "CacheStats",
    "CostModel",
    "DiskLoad",
    "L3Worker",
    "LoadTicket",
    "PrefetchHold",
    "TierController",
    "Transfers",
    "WritePolicy",
]
