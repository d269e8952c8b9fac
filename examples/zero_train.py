"""ZeRO on your own model: torchrun --nproc_per_node=2 examples/zero_train.py [--stage 1|2]

zero.ZeroOptimizer wraps a standard torch optimizer; each rank keeps 1/W of its state (and,
at stage 2, of the gradients)."""
import argparse

import torch

import zero
from common import STEPS, TinyLM, batch, finish, init, log, loss_fn, no_decay_groups

p = argparse.ArgumentParser()
p.add_argument("--stage", type=int, default=2)
p.add_argument("--save", default="/tmp/zero_example_optimizer.pt",
               help="where rank 0 writes the unsharded optimizer state")
args = p.parse_args()
device, rank = init()
model = TinyLM().to(device)
opt = zero.ZeroOptimizer(no_decay_groups(model, 0.1), torch.optim.AdamW, stage=args.stage,
                         lr=3e-3)                       # broadcasts rank 0's weights
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
for step in range(STEPS):
    loss = loss_fn(model, batch(rank, step).to(device))
    loss.backward()                                     # stage 2: reduce-scattered here
    norm = opt.clip_grad_norm_(1.0)                     # the global norm of the average
    opt.step()                                          # 1/W of AdamW, then all-gather
    opt.zero_grad()
    sched.step()
    log(step, loss, extra=f"  grad norm {norm:.3f}")
state = opt.state_dict()                                # collective: the unsharded state
if rank == 0:
    torch.save(state, args.save)                        # loadable by torch.optim.AdamW too
    print(f"saved the optimizer state of {len(state['state'])} parameters", flush=True)
finish()
