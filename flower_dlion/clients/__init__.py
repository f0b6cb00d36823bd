"""Client side of flower-dlion: :class:`DLionClient`, and what it is built from."""

from .dlion import ClientSettings, ClientStateError, DLionClient

__all__ = ["ClientSettings", "ClientStateError", "DLionClient"]
