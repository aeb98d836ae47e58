"""The node-local checkpoint tier: frequent saves of each rank's whole state
to fast node-local storage (/dev/shm), copied to peers on other nodes, so a
killed rank or a lost node costs at most the steps since the last local save.

    shard.py        a rank's state as one shard in memory (bytes + meta)
    store.py        one node's directory of shards on disk
    runs.py         whose shards are whose: the local root, one directory per run
    replication.py  who holds whose shards and how they move (pure bookkeeping)
    cadence.py      when to save, and the pause after a failed save
    tier.py         LocalTier: saving, replicating and recovering, on a thread of its own

How it works, and why it is built so: docs/local-tier.md.
"""
