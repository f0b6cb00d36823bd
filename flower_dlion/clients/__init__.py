"""Client side of flower-dlion: :class:`DLionClient` (public), and the repository app's baseline clients."""

from .dlion import ClientSettings, ClientStateError, DLionClient

__all__ = ["ClientSettings", "ClientStateError", "DLionClient"]
