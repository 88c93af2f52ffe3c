"""Tensor parallelism over torch.distributed on one host.

  sharding.py     which heads / rows / columns of each tensor a rank holds (pure math)
  group.py        the communicators and the collectives the model and runner use
  step_channel.py the driver's per-step host arrays, packed into one int tensor and broadcast
  worker.py       a worker rank's process: builds its shard, then follows the driver's steps
  launcher.py     the driver side: start-up checks, spawning the workers, shutdown

Rank 0 (the driver) is the engine itself; ranks 1..N-1 are spawned workers.
docs/ARCHITECTURE.md ("Tensor parallelism") explains the design.
"""
