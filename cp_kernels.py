"""cp_kernels.py: fused block kernels for cp_ring.py's ring, and the check that they keep its
contract.

cp_ring.TorchKernel computes one block of attention in plain torch (the exact float64 proofs)
and states the contract: forward gives the block's state for the online-softmax merge, backward
the block's (dq, dk, dv) from the final out, lse and delta. On a GPU the same contract is kept
by PyTorch's fused attention kernels that return the log-sum-exp (the ATen ops behind
F.scaled_dot_product_attention): SDPAKernel. Before a run uses one, `self_test` checks it on a
small causal block against the pure kernel; `pick_kernel` chooses (--attn-kernel
auto|sdpa|torch) and says which and why in one line.

    kernel, line = pick_kernel("auto", device, dtype)    # cp_ring.parallelize(..., kernel=kernel)
    reference_attention(q, k, v, scale)                   # one device's causal attention
"""
import torch
import torch.nn.functional as F

from cp_ring import TorchKernel, _acc_dtype


def _expand(x, n_rep):
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)   # (B, n_kv, ..) -> (B, n_h, ..)


def _reduce_rep(x, n_rep):
    if n_rep == 1:
        return x
    B, H, n, d = x.shape
    return x.view(B, H // n_rep, n_rep, n, d).sum(2)   # (B, n_h, c, d) -> (B, n_kv, c, d)


class SDPAKernel(TorchKernel):
    """PyTorch's fused attention kernels that return the log-sum-exp (the ATen ops behind
    F.scaled_dot_product_attention): FlashAttention-2 for bf16/fp16 on CUDA, the
    memory-efficient kernel for fp32 on CUDA, the CPU flash kernel on CPU. Inputs stay in their
    dtype (no fp32 (B, n_h, c_q, c_k) scores); the block's out and lse enter the fp32 merge. A block
    the fused kernels cannot express (a diagonal whose query and key ranges differ) takes the
    pure kernel."""
    one_call = True   # a zig-zag ring step in one call (cp_ring._calls): causal blocks skipped

    def __init__(self, device_type: str, dtype):
        if device_type == "cpu":
            self.op, self.name = "cpu", "sdpa-cpu-flash"
        elif dtype in (torch.bfloat16, torch.float16):
            self.op, self.name = "flash", "sdpa-flash"
        else:
            self.op, self.name = "efficient", "sdpa-efficient"
        self._aux = None   # the last forward's non-varlen placeholders (cu_seqlens, rng state)

    def operand_dtype(self, q):   # dO and O in the inputs' dtype, as the fused backward takes
        return q.dtype

    @staticmethod
    def fused(rel, qr, kr):
        return rel == "full" or (rel == "mask" and qr == kr)

    def _fwd(self, q, k, v, scale, causal):
        A = torch.ops.aten
        if self.op == "cpu":
            return A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                 scale=scale)
        if self.op == "flash":
            out, lse, cq, ck, _, _, seed, off, _ = A._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)
            self._aux = (cq, ck, seed, off)
            return out, lse
        out, lse, seed, off = A._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        self._aux = (seed, off)
        return out, lse[..., :q.shape[2]]            # (B, n_h, c_q): lse comes padded to 32s

    def _bwd(self, do, q, k, v, out, lse, scale, causal):
        A = torch.ops.aten
        if self.op == "cpu":
            return A._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, out, lse, 0.0, causal, scale=scale)
        if self.op == "flash":
            cq, ck, seed, off = self._aux
            return A._scaled_dot_product_flash_attention_backward(
                do, q, k, v, out, lse, cq, ck, q.shape[2], k.shape[2], 0.0, causal, seed, off,
                scale=scale)
        seed, off = self._aux
        pad = -q.shape[2] % 32
        lse = F.pad(lse, (0, pad)) if pad else lse   # (B, n_h, c_q) -> (B, n_h, c_q + pad)
        return A._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, seed, off, 0.0, [True, True, True, False], causal,
            scale=scale)[:3]

    def _kv(self, q, k, v):
        """K/V for the fused op: the CPU flash kernel takes the kv heads as they are (GQA);
        the CUDA ops get them repeated (not verified on a GPU with fewer kv heads)."""
        n = 1 if self.op == "cpu" else q.shape[1] // k.shape[1]
        return _expand(k, n).contiguous(), _expand(v, n).contiguous(), n   # CUDA: (B, n_h, c_k, d)

    def forward(self, q, k, v, scale, rel, qr, kr, acc_dtype):
        if not self.fused(rel, qr, kr):
            return super().forward(q, k, v, scale, rel, qr, kr, acc_dtype)
        k, v, _ = self._kv(q, k, v)
        out, lse = self._fwd(q.contiguous(), k, v, scale, rel == "mask")
        lse = lse.to(acc_dtype)
        return out.to(acc_dtype), torch.ones_like(lse), lse   # (B, n_h, c_q, d), l = 1, lse

    def backward(self, q, k, v, do, out, lse, delta, scale, rel, qr, kr):
        if not self.fused(rel, qr, kr):
            return super().backward(q, k, v, do, out, lse, delta, scale, rel, qr, kr)
        dt = q.dtype
        k, v, n = self._kv(q, k, v)
        dq, dk, dv = self._bwd(do.to(dt).contiguous(), q.contiguous(), k, v,
                               out.to(dt).contiguous(), lse.to(_acc_dtype(q)).contiguous(),
                               scale, rel == "mask")
        # dq (B, n_h, c_q, d); dk, dv (B, n_h, c_k, d) -> (B, n_kv, c_k, d)
        return dq.to(do.dtype), _reduce_rep(dk, n).to(do.dtype), _reduce_rep(dv, n).to(do.dtype)


def self_test(kernel, device, dtype) -> str | None:
    """A fused kernel's forward and backward on one small causal block against the pure one
    (errors within 8x bf16/fp32 rounding): None when it agrees, else why not."""
    g = torch.Generator().manual_seed(0)   # (2 query heads on 1 kv head: the GQA path too)
    q, k, v, do = (torch.randn(1, h, 64, 64, generator=g).to(device, dtype) for h in (2, 1, 1, 2))
    acc = _acc_dtype(q)
    try:
        res = []
        for kern in (kernel, TorchKernel()):
            a, l, m = kern.forward(q, k, v, 0.125, "mask", (0, 64), (0, 64), acc)
            out, lse = a / l[..., None], m + torch.log(l)
            delta = (do.to(acc) * out).sum(-1)
            res.append((out, *kern.backward(q, k, v, do.to(acc), out, lse, delta, 0.125,
                                            "mask", (0, 64), (0, 64))))
        tol = 8 * torch.finfo(dtype).eps * 64
        err = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(*res))
        return None if err <= tol else f"max rel err {err:.1e} > {tol:.1e}"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def pick_kernel(choice: str, device: torch.device, dtype) -> tuple[TorchKernel, str]:
    """The block kernel for --attn-kernel auto|sdpa|torch, and a line saying which and why.
    auto: the fused SDPA kernels on CUDA (after their self-test), pure torch on CPU (the exact
    float64 proofs). flash-attn's own package is not used: its block API differs between
    releases, and PyTorch's built-in flash kernel is the same algorithm."""
    if choice == "torch" or (choice == "auto" and device.type != "cuda") \
            or dtype == torch.float64:
        why = "float64" if dtype == torch.float64 and choice != "torch" else choice
        return TorchKernel(), f"attention block kernel: torch (pure; {why})"
    kern = SDPAKernel(device.type, dtype)
    bad = self_test(kern, device, dtype)
    if bad:
        return TorchKernel(), (f"attention block kernel: torch ({kern.name} failed its "
                               f"self-test: {bad})")
    return kern, f"attention block kernel: {kern.name} (fused, log-sum-exp; self-test passed)"


def reference_attention(q, k, v, scale):
    """Full causal attention on one device (for the standalone check): q (B, n_h, S, d),
    k, v (B, n_kv, S, d) repeated to n_h heads -> (B, n_h, S, d)."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _expand(k, n_rep), _expand(v, n_rep),
                                          is_causal=True, scale=scale)
