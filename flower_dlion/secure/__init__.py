"""Secure aggregation of the vote: clients upload their signs masked over Z_{2^b}; the server learns only the counts.

:mod:`.masking` is the arithmetic (bit-sliced pairwise masks and self-masks, per-round seeds);
the client's side is :mod:`flower_dlion.clients.secure_client`, the server's
:mod:`flower_dlion.strategies.secure_rounds`. docs/USER_GUIDE.md, "Secure aggregation", has the
protocol and its threat model.
"""
