"""Fault points for the kill -9 chaos harness (tests/chaos/): the engine's
(``cairn/chaos.h`` says how ``CAIRN_CHAOS="PHASE:N:RANKS"`` arms one). Unset,
every call is a cheap no-op."""

from cairn._ext import chaos_arm as arm, chaos_point as point

__all__ = ["arm", "point"]
