"""An Accelerate training loop as its users write it, with or without a DeepSpeedPlugin.

    deepspeed --num_gpus 2 accelerate_loop.py --zero_stage 2 --out losses.json

``--zero_stage 0`` runs without DeepSpeed (Accelerate's CPU DDP). Without ``--zero_stage`` the script is
what ``accelerate launch`` runs: a plain ``Accelerator()`` that takes DeepSpeed (or not) from the
launcher's environment. Rank 0 writes the loss of every step
(averaged over the ranks) and the loss over the whole data set before and after training to ``--out``
as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from baseline_exit import leave_baseline
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 5
CLIP = 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, help="none: whatever `accelerate launch` chose")
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload", action="store_true", help="offload the optimizer to the CPU")
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's; Accelerate reads the env
    args = parser.parse_args()

    plugin = None
    if args.zero_stage is None:  # accelerate launch: DeepSpeed, its stage and clipping from the environment
        accelerator = Accelerator()
    elif args.zero_stage:
        plugin = DeepSpeedPlugin(
            zero_stage=args.zero_stage,
            gradient_accumulation_steps=1,
            gradient_clipping=CLIP,
            # Accelerate then swaps the torch AdamW for deepspeed.ops.adam.DeepSpeedCPUAdam
            offload_optimizer_device="cpu" if args.offload else "none",
        )
    if args.zero_stage is not None:  # without DeepSpeed a CPU-only host needs Accelerate's CPU mode for DDP
        accelerator = Accelerator(deepspeed_plugin=plugin, cpu=plugin is None)
    ds = accelerator.state.deepspeed_plugin

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4 * STEPS, 8, generator=gen)
    y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(4 * STEPS, 1, generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)
    with torch.no_grad():
        initial = nn.functional.mse_loss(model(x), y).item()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    model.train()
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        if ds is None:
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    with torch.no_grad():  # the whole data set through the trained model (ZeRO-3 gathers as it goes)
        final = nn.functional.mse_loss(model(x.to(accelerator.device)), y.to(accelerator.device)).item()
    info = {
        "losses": losses,
        "initial_loss": initial,
        "final_loss": final,
        "num_processes": accelerator.num_processes,
        "type": str(accelerator.distributed_type),
        "zero_stage": ds.zero_stage if ds is not None else 0,
    }
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(info, f)
    # What Accelerate's examples end with: it destroys the process group, without which the DDP run (the
    # group is Accelerate's own there, not dslaunch's) can abort in interpreter shutdown while a gloo thread
    # frees its last collective (SIGABRT, "terminate called without an active exception"; seen on the
    # 16-core GPU host); the barrier first: a rank that destroys the group while the other still runs its
    # last collective aborts the same way (seen 1 in 4 under torchrun on the 2-core CPU host)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if ds is None:
        leave_baseline()  # the plain DDP baseline: torch's own group, see baseline_exit


if __name__ == "__main__":
    main()
