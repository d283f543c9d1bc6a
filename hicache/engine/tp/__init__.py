"""Tensor parallelism: the model cut into shards (shard.py), rank 0's engine (engine.py) driving the other ranks
(follower.py) in lockstep (lockstep.py) over a process group (group.py), and the tier ports that replay rank 0's
cache decisions on every rank (ports.py)."""
