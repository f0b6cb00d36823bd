"""flower-dlion: Distributed Lion for Flower, 1 bit per parameter up, a packed Δ down.

The bit codec (:mod:`flower_dlion.codec`) and the Lion math (:mod:`flower_dlion.lion`)
import only torch and numpy; the strategy (:mod:`flower_dlion.strategies.dlion`) and the
client (:mod:`flower_dlion.clients.dlion`) put them on Flower's Message API.
"""

__version__ = "0.1.0"
