"""Flower strategies of flower-dlion."""

from .dlion import DistributedLion, RejectedReply

__all__ = ["DistributedLion", "RejectedReply"]
