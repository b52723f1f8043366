"""A stage's state: checkpoints on disk, snapshots in memory, learning-rate schedules."""
