"""A stand-in for benchmarks._deepspeed_peer in tests: speaks its protocol without DeepSpeed.

The stage is the reverse of the rank (so the launcher must sort by stage, not by rank),
the peak is ``1000 * (rank + 1) * dim``; with ``--optimizer adam`` rank 2 fails.
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
for flag in ("--dim", "--layers"):
    parser.add_argument(flag, type=int)
parser.add_argument("--optimizer")
args = parser.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
if args.optimizer == "adam" and rank == 2:
    print("Traceback: gloo could not connect", flush=True)
    sys.exit(3)
print("some DeepSpeed log line")
print(json.dumps({"stage": world - 1 - rank, "peak_rss_bytes": 1000 * (rank + 1) * args.dim}))
