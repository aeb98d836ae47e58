"""The generation's abort record in the store: the first failing rank
announces its cause, every rank reads the same one, and a closed connection
is told apart from a peer tearing down after an announced abort.
docs/fault-tolerance.md ("Restarts") says it for users."""
from __future__ import annotations

from typing import Optional, Union

import torch.distributed as dist

from megaresil.compat import lost_peer_error
from megaresil.resilience.coordination import JobStore


class AbortBoard:
    """The generation's abort record in the store: the first failing rank
    announces it (compare-and-set), every rank reads the same cause."""

    def __init__(self, store: Union[dist.Store, JobStore], rank: int):
        self.store, self.rank = JobStore.of(store), rank

    def announced(self, generation: int) -> bool:
        return self.store.aborted(generation)

    def announce(self, generation: int, err: BaseException, reason: str = "error") -> str:
        """Announce this rank's failure unless a rank already did; returns
        the first announced cause."""
        return self._describe(self._first(generation, err, reason))

    def _first(self, generation: int, err: BaseException, reason: str) -> dict:
        return self.store.announce_abort(generation, {
            "reason": reason, "rank": self.rank, "error": f"{type(err).__name__}: {err}"[:500]})

    def fatal(self, generation: int, err: BaseException) -> Optional[dict]:
        """Announce `err` as fatal unless another cause came first; the
        first announcement when it is fatal (every rank stops), else None."""
        first = self._first(generation, err, "fatal")
        return first if first.get("reason") == "fatal" else None

    def fatal_announced(self, generation: int) -> bool:
        return self.first_reason(generation) == "fatal"

    def first_reason(self, generation: int) -> Optional[str]:
        """The reason of the generation's first announcement ("error",
        "fatal", "hang", "lost_peer"), None before any."""
        first = self.store.abort(generation)
        return None if first is None else first.get("reason")

    @staticmethod
    def _describe(first: dict) -> str:
        if first.get("reason") == "hang":
            return (f"hang on rank(s) {first.get('culprit_ranks')} in {first.get('section')} "
                    f"at step {first.get('step')}")
        return f"rank {first['rank']}: {first['error']}"

    def peer_gone(self, generation: int, err: BaseException) -> bool:
        """A connection closed under us means a lost peer, unless a peer
        announced this generation's abort first: then it is that (live) peer
        tearing down its process group before we heard of the abort."""
        if not lost_peer_error(err):
            return False
        try:
            return not self.announced(generation)
        except dist.DistNetworkError:  # the store went with the peer: its node is lost
            return True
