"""Every use of a private torch API, in one place.

Each function names what it reaches into. They were checked on the torch
versions in CHECKED_TORCH; a torch outside that range is refused at import
with a message naming the versions, instead of failing later in a worker.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def process_groups() -> list[dist.ProcessGroup]:
    """Every live process group of this process (c10d's private registry)."""
    return list(dist.distributed_c10d._world.pg_map)


def set_gloo_timeout(group: dist.ProcessGroup, seconds: float) -> bool:
    """Timeout of the group's gloo collectives started from now on; False
    when the group has no gloo backend (NCCL has its own watchdog and abort).
    An op already blocked keeps the timeout it started with."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    backend._set_default_timeout(timedelta(seconds=seconds))
    return True


def abort_process_groups() -> None:
    """Abort every process group's communicators (NCCL frees blocked
    collectives this way; gloo ignores it, see design.md §4)."""
    dist.distributed_c10d._abort_process_group()


# gloo reports a lost peer as a plain RuntimeError; its transport's message is
# the only sign (checked on 2.13). NCCL and the c10d store raise typed errors.
_GLOO_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "connectFullMesh failed")


def lost_peer_error(err: BaseException) -> bool:
    """Whether a collective failed because a peer process is gone."""
    if isinstance(err, dist.DistNetworkError):
        return True
    return type(err) is RuntimeError and any(m in str(err) for m in _GLOO_LOST_PEER)


def collective_counts(exclude: set) -> dict[str, int]:
    """Collectives issued so far on each process group of this process, by
    group name (the same on every member). A group numbers its collectives
    in the same order on all members, so a member with a lower count has not
    yet joined a collective its peers started. Groups in `exclude` are left out."""
    counts = {}
    for group in process_groups():
        if group in exclude:
            continue
        try:
            counts[group.group_name] = group._get_sequence_number_for_group()
        except RuntimeError:  # a backend that does not number its collectives
            pass
    return counts


def has_nccl_groups() -> bool:
    """Whether any live process group runs collectives through NCCL."""
    return any("nccl" in dist.get_backend(group) for group in process_groups())
