"""LoRA fine-tuning under tensor parallelism: torchrun --nproc_per_node=2 examples/lora_train.py

peft wraps the model as usual (LoraConfig + get_peft_model); tp.parallelize then splits the
frozen base and the adapters by the base's kind (lora.py): B like a column layer's rows, A like
a row layer's columns, the other adapter whole with a partial gradient that
tpm.reduce_partial_grads() sums. The optimizer gets the adapters only. At the end the full
adapters are gathered and exported: a merged HF directory and peft's adapter directory."""
import argparse
import tempfile

import peft
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import lora
import tp
from common import STEPS, batch, finish, init, llama_config, log

p = argparse.ArgumentParser()
p.add_argument("--out", default=None, help="export directory (default: a temporary one)")
args = p.parse_args()
device, rank = init()
torch.manual_seed(0)                                   # the same full weights on every rank
config = llama_config()
model = LlamaForCausalLM(config).to(device)
lora_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
peft.get_peft_model(model, lora_config)                # the base frozen, adapters injected
tpm = tp.parallelize(model, None)                      # base and adapters split by kind
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
for step in range(STEPS):
    seq = batch(0, step).to(device)                    # one batch for the whole TP group
    logits = model(input_ids=seq[:, :-1]).logits       # this rank's slice of the vocabulary
    loss = tpm.loss_sum(logits, seq[:, 1:]) / seq[:, 1:].numel()
    loss.backward()
    tpm.reduce_partial_grads()                         # the adapters' partial gradients
    tpm.clip(1.0)
    opt.step()
    opt.zero_grad()
    log(step, loss)
seq = batch(0, STEPS).to(device)                       # a batch it has not seen
with torch.no_grad():
    tp_loss = tpm.loss_sum(model(input_ids=seq[:, :-1]).logits, seq[:, 1:]) / seq[:, 1:].numel()
full = tpm.full({n: q.detach() for n, q in model.named_parameters()})   # collective
if rank == 0:
    out = args.out or tempfile.mkdtemp()
    lora.export({n: t.cpu() for n, t in full.items()}, config, lora_config, out)
    merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged")   # W + (alpha/r) B A
    with torch.no_grad():
        logits = merged(input_ids=seq[:, :-1].cpu()).logits
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), seq[:, 1:].cpu().reshape(-1))
    print(f"exported {out}/merged and {out}/adapter: the merged model's loss {loss:.6f}, "
          f"the tp model's {tp_loss:.6f}", flush=True)
finish()
