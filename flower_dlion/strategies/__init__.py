"""Server side of flower-dlion: the Distributed Lion strategy."""

from .dlion import DistributedLion, RejectedReply

__all__ = ["DistributedLion", "RejectedReply"]
