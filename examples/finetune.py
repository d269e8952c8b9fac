"""Fine-tuning a pretrained HF checkpoint with data parallelism:

    torchrun --nproc_per_node=2 examples/finetune.py --model DIR --data train.txt --out OUT
    torchrun --nproc_per_node=8 examples/finetune.py --model DIR --data train.txt --out OUT --zero 2

DIR is a local HF checkpoint directory (config.json, safetensors weights, tokenizer files: what
save_pretrained writes, or a downloaded model). Its tokenizer turns the text (documents
separated by blank lines) into one token stream, each document followed by EOS, cut into
blocks of --length tokens; the last --val-blocks blocks are held out. A torch DataLoader with a
DistributedSampler gives every rank its own blocks, reshuffled each epoch.

Precision: on a GPU with bf16, the forward runs under bf16 autocast while the weights, their
gradients and AdamW's state stay fp32 (--precision fp32 turns it off); on CPU the default is
fp32 (--precision bf16 forces autocast there too).

Parallelism: ddp.DataParallel averages the gradients over the ranks (--zero 0, the default);
--zero 1 or 2 instead wraps AdamW in zero.ZeroOptimizer, which keeps 1/W of its state (and at
stage 2 of the gradients) on each rank. Either way every rank holds the full weights after a
step, so the global-norm clip is one call and rank 0 saves the model with save_pretrained:
OUT then loads with AutoModelForCausalLM.from_pretrained(OUT), tokenizer included, and
OUT/optimizer.pt holds the (unsharded) optimizer state and the step count."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

import ddp
import zero
from common import finish, init, no_decay_groups


def token_blocks(tokenizer, path: str, length: int) -> torch.Tensor:
    """(n, length) token ids: the documents of `path` (separated by blank lines), each followed
    by EOS, joined and cut into blocks (the remainder dropped)."""
    with open(path) as f:
        docs = [d.strip() for d in f.read().split("\n\n") if d.strip()]
    ids = []
    for doc in docs:
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // length
    return torch.tensor(ids[:n * length]).view(n, length)


@torch.no_grad()
def held_out_loss(net, blocks: torch.Tensor, device) -> float:
    """Mean next-token loss over the held-out blocks, fp32, no autocast (every block has the
    same number of targets, so the mean of the block means is the token mean)."""
    net.eval()
    losses = [net(input_ids=b[None].to(device), labels=b[None].to(device)).loss for b in blocks]
    net.train()
    return float(torch.stack(losses).mean())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a local HF checkpoint directory")
    p.add_argument("--data", required=True, help="a text file, documents separated by blank lines")
    p.add_argument("--out", required=True, help="where rank 0 saves the fine-tuned model")
    p.add_argument("--length", type=int, default=64, help="tokens per block")
    p.add_argument("--batch", type=int, default=4, help="blocks per rank per step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--val-blocks", type=int, default=4)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2],
                   help="0: ddp.DataParallel; 1, 2: zero.ZeroOptimizer of that stage")
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()

    device, rank = init()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    net = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda"
                                        and torch.cuda.is_bf16_supported())

    blocks = token_blocks(tokenizer, args.data, args.length)
    train, val = blocks[:-args.val_blocks], blocks[-args.val_blocks:]
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)   # rank, W: dist's
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True)

    groups = no_decay_groups(net, weight_decay=0.1)
    if args.zero:
        model = net          # ZeroOptimizer broadcasts rank 0's weights and shards AdamW's state
        opt = zero.ZeroOptimizer(groups, torch.optim.AdamW, stage=args.zero, lr=args.lr)
    else:
        model = ddp.DataParallel(net)                 # rank 0's weights and buffers broadcast
        opt = torch.optim.AdamW(groups, lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    before = held_out_loss(net, val, device)
    if rank == 0:
        print(f"{len(train)} training blocks of {args.length} tokens, {len(loader)} steps per "
              f"epoch per rank; {'bf16 autocast' if bf16 else 'fp32'}; "
              f"{f'ZeRO-{args.zero}' if args.zero else 'DataParallel'}", flush=True)
        print(f"held-out loss before {before:.6f}", flush=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                      # a new shuffle, the same on every rank
        for x in loader:
            x = x.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=x, labels=x).loss   # HF shifts the labels itself
            loss.backward()                           # gradients averaged over the ranks
            if args.zero:
                opt.clip_grad_norm_(args.clip)        # the global norm of the averaged shards
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()
            sched.step()
            if step % args.log_every == 0:
                mean = loss.detach().clone()
                dist.all_reduce(mean)                 # every rank's loss, averaged for the log
                if rank == 0:
                    print(f"step {step:3d}  loss {float(mean) / dist.get_world_size():.4f}",
                          flush=True)
            step += 1

    after = held_out_loss(net, val, device)
    state = opt.state_dict()                          # ZeRO: a collective (unsharded state)
    if rank == 0:
        net.save_pretrained(args.out)                 # the full fp32 weights (safetensors)
        tokenizer.save_pretrained(args.out)
        torch.save({"optimizer": state, "step": step}, os.path.join(args.out, "optimizer.pt"))
        print(f"held-out loss after {after:.6f}", flush=True)
        print(f"saved {args.out}", flush=True)
    finish()


if __name__ == "__main__":
    main()
