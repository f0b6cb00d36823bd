"""The repository app's baseline strategies: the gradient baselines (GlobalOptimizer) and SCAFFOLD."""

from .global_opt import GlobalOptimizer
from .scaffold import Scaffold

__all__ = ["GlobalOptimizer", "Scaffold"]
