"""Flower strategies of flower-dlion: Distributed Lion and the gradient baselines."""

from .dlion import DistributedLion, RejectedReply
from .global_opt import GlobalOptimizer

__all__ = ["DistributedLion", "GlobalOptimizer", "RejectedReply"]
