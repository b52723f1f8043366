"""Building a stage's model: its layers, traced slices, tied parameters, tensor-parallel shards."""
