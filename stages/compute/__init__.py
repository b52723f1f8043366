"""Running a stage's step: the executor, weight gradients, activation checkpointing, the inline fast path."""
