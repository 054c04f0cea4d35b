"""How many WatchEvents streams run at once: in all (``SCHEDULER_WATCH_MAX``) and per caller
identity (``SCHEDULER_WATCH_MAX_PER_CALLER``); beyond, RESOURCE_EXHAUSTED.

Why: each watcher holds a subscription, its history replay and a send buffer; 500 opened at
once stalled every RPC for 1-3 s, and nothing bounded their number. The identity is the client
certificate's (common name and names) under mTLS, the peer's address otherwise. Pure apart
from its counters, which only this process's event loop touches.
"""

from __future__ import annotations


class WatchLimits:
    def __init__(self, total: int, per_caller: int) -> None:
        self.total = total
        self.per_caller = per_caller
        self._open = 0
        self._by_caller: dict[str, int] = {}

    @property
    def open(self) -> int:
        return self._open

    def acquire(self, caller: str) -> str | None:
        """Count a new watcher of ``caller``, or say why not (nothing counted then)."""
        if self._open >= self.total:
            return (f"{self._open} WatchEvents streams are open, the most this scheduler "
                    f"serves (SCHEDULER_WATCH_MAX={self.total}); retry later")
        mine = self._by_caller.get(caller, 0)
        if mine >= self.per_caller:
            return (f"{mine} WatchEvents streams of this caller ({caller}) are open, the most "
                    f"one caller may have (SCHEDULER_WATCH_MAX_PER_CALLER={self.per_caller})")
        self._open += 1
        self._by_caller[caller] = mine + 1
        return None

    def release(self, caller: str) -> None:
        mine = self._by_caller.get(caller, 0)
        if mine <= 0:
            return
        self._open -= 1
        if mine == 1:
            del self._by_caller[caller]
        else:
            self._by_caller[caller] = mine - 1


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``; ``ipv6:[::1]:5000`` -> ``[::1]``."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, _port = rest.rpartition(":")
        return host or rest
    return peer
