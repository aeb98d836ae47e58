"""Hot spares' node counts (launch/spares.py): the rendezvous takes the
nodes the layout trains on, the rest wait as spares."""
from __future__ import annotations

import pytest

from megaresil.config import ConfigError
from megaresil.launch.membership import Membership
from megaresil.launch.spares import NodeCounts, node_counts


def test_spares_wait_beyond_the_nodes_the_layout_trains_on():
    # 8 ranks on nodes of 4: 2 nodes train; --spares 1 and MAX 3 each make a spare.
    assert node_counts(2, 2, 1, 8, 4, "c10d") == NodeCounts(2, 2, 1)
    assert node_counts(1, 3, 0, 8, 4, "etcd-v2") == NodeCounts(2, 2, 1)
    assert node_counts(1, 3, 1, 8, 4, "c10d") == NodeCounts(2, 2, 2)


def test_without_spares_the_counts_are_the_users():
    assert node_counts(1, 2, 0, 8, 4, "c10d") == NodeCounts(1, 2, 0)


def test_spares_need_whole_nodes_and_the_dynamic_rendezvous():
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        node_counts(1, 3, 0, 6, 4, "c10d")
    with pytest.raises(ConfigError, match="etcd-v2"):
        node_counts(2, 2, 1, 8, 4, "etcd")


def test_spares_are_for_a_job_of_several_nodes():
    with pytest.raises(ConfigError, match="--spares"):
        Membership.parse(None, 2, None, None, spares=1)
    assert Membership.parse("2", 4, "node0:29400", "job", spares=1).spares == 1
