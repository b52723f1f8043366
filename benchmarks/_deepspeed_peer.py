# Run by benchmarks.memory (benchmarks._memory_states.deepspeed_peer): one process per pipeline stage.
"""One rank of DeepSpeed's pipeline engine training ``benchmarks.memory``'s layer stack.

The launcher sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (one process per stage, gloo); this process builds a ``PipelineModule``
of ``LayerSpec(nn.Linear, dim, dim)`` layers (each stage builds only its own, as DeepSpeed
users give a large model), trains ``--steps`` steps of 8 micro-batches of 2 rows with
torch's SGD or Adam as the client optimizer, and prints one JSON line: its stage and its
process's peak RSS (``VmHWM``) at the end. Not imported by anything else: DeepSpeed is no
dependency of this project.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # as the actorpipe stages run (threads_per_stage=1)
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(torch.nn.Linear, args.dim, args.dim) for _ in range(args.layers)],
                           num_stages=world, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.01) if args.optimizer == "sgd" else torch.optim.Adam(params, lr=1e-4)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randn(16, args.dim, generator=generator) for _ in range(2))
    for _ in range(args.steps):
        batches = iter([(inputs[i:i + 2], targets[i:i + 2]) for i in range(0, 16, 2)])
        engine.train_batch(data_iter=batches)
    from benchmarks.memory import _status_bytes

    print(json.dumps({"stage": engine.stage_id, "peak_rss_bytes": _status_bytes(os.getpid(), "VmHWM")}), flush=True)


if __name__ == "__main__":
    main()
