"""The output projection and the cross-entropy as one operator that never holds the logits.

[Note: the logits are never whole]
A decoder's last step, ``F.linear(h, W)`` then cross-entropy, holds [tokens, vocab] logits, and
backward holds their gradient beside them: for qwen3-1.7b at micro-batch 4, seq 4096 (16,384
tokens, vocab 151,936) that is 4.6 GiB of bf16 logits plus 4.6 GiB of bf16 gradient, at the start
of backward, exactly where the optimizer's state is also resident. Measured on one H200 at
``--mem-frac`` 0.25 they were what kept step 1 from fitting (benches/results/floor17b.md).

``linear_cross_entropy`` computes the same mean fp32 loss one slice of the vocabulary at a time:

- forward: for each slice of ``columns`` rows of ``W``, the slice's logits (``h @ W_s.T``, in the
  operands' dtype, upcast to fp32), merged into a running fp32 log-sum-exp per token, and the
  target's logit picked where it falls in the slice. It keeps ``h``, ``W``, the targets and the
  fp32 log-sum-exp ([tokens]), nothing [tokens, vocab].
- backward: the slice's logits again (one more matmul of the head, the price of the memory), its
  softmax from the saved log-sum-exp, minus one at the target, times the upstream gradient; then
  ``grad_W`` for the slice in one matmul (written once, no partial sums) and ``grad_h`` summed
  over slices in fp32.

The two halves are opaque custom operators (``zbuf_fused::linear_cross_entropy`` and its
backward; a namespace of their own, since every ``zbuf::`` operator is on the schedule's token
chain), not traced Python, on purpose: traced, Inductor fused the chunks' partial sums into one kernel that
held every chunk's product at once, and the min-cut partitioner moved the chunks' recompute into
the forward (branch ``fusedce``, 2026-12-02). Opaque, the compiler schedules one node each; what
they allocate inside is their ``workspace_bytes``, which zbuf's activation profile adds at their
node (graph_info.activation_profile), so the memory plan still sees it.

Numerics: in fp32 the value and both gradients equal ``F.cross_entropy(F.linear(h, W))`` to fp32
rounding (the sums are taken in a different order). In bf16 ``grad_W`` rounds once, as the
unfused product does; ``grad_h`` rounds each slice's bf16 product before the fp32 sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["linear_cross_entropy", "LOGITS_SLICE_BYTES", "workspace_bytes", "matmul_flops"]

LOGITS_SLICE_BYTES = 256 << 20
"""fp32 bytes of one vocabulary slice's logits (all tokens): bounds the operator's workspace."""


def _columns(tokens: int, vocab: int) -> int:
    return max(1, min(vocab, LOGITS_SLICE_BYTES // (4 * max(1, tokens))))


def _slice_logits(hidden: Tensor, weight: Tensor, start: int, stop: int) -> Tensor:
    return torch.mm(hidden, weight[start:stop].t()).float()


def _in_slice(safe: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Which targets fall in the slice [start, stop), and each one's column there (clamped, so
    that every row has one to index)."""
    return (safe >= start) & (safe < stop), (safe - start).clamp(0, stop - start - 1)


@torch.library.custom_op("zbuf_fused::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
             columns: int) -> tuple[Tensor, Tensor]:
    """(sum of the valid tokens' losses, fp32 log-sum-exp per token)."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    lse = torch.full(targets.shape, float("-inf"), dtype=torch.float32, device=hidden.device)
    picked = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, weight.shape[0], columns):
        stop = min(start + columns, weight.shape[0])
        logits = _slice_logits(hidden, weight, start, stop)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        inside, at = _in_slice(safe, start, stop)
        picked += torch.where(inside, logits.gather(1, at[:, None]).squeeze(1), 0.0)
        del logits
    total = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    return total, lse


@_forward.register_fake
def _(hidden, weight, targets, ignore_index, columns):
    return (hidden.new_empty((), dtype=torch.float32),
            hidden.new_empty(targets.shape, dtype=torch.float32))


@torch.library.custom_op("zbuf_fused::linear_cross_entropy_backward", mutates_args=())
def _backward(grad_total: Tensor, hidden: Tensor, weight: Tensor, targets: Tensor, lse: Tensor,
              ignore_index: int, columns: int) -> tuple[Tensor, Tensor]:
    """(grad of hidden, grad of weight) of ``grad_total * total``."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    scale = torch.where(valid, grad_total.float().expand_as(lse), torch.zeros_like(lse))
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.empty_like(weight)
    for start in range(0, weight.shape[0], columns):
        stop = min(start + columns, weight.shape[0])
        p = _slice_logits(hidden, weight, start, stop)
        p.sub_(lse[:, None]).exp_()
        inside, at = _in_slice(safe, start, stop)
        p.scatter_add_(1, at[:, None], -(valid & inside).to(p.dtype)[:, None])
        p.mul_(scale[:, None])
        p = p.to(weight.dtype)
        torch.mm(p.t(), hidden, out=grad_weight[start:stop])
        grad_hidden += torch.mm(p, weight[start:stop])
        del p
    return grad_hidden.to(hidden.dtype), grad_weight


@_backward.register_fake
def _(grad_total, hidden, weight, targets, lse, ignore_index, columns):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, targets, ignore_index, columns = inputs
    _, lse = output
    ctx.save_for_backward(hidden, weight, targets, lse)
    ctx.ignore_index, ctx.columns = ignore_index, columns
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_total, _grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.zbuf_fused.linear_cross_entropy_backward(
        grad_total, hidden, weight, targets, lse, ctx.ignore_index, ctx.columns)
    return grad_hidden, grad_weight, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                         ignore_index: int = -100) -> Tensor:
    """Mean fp32 cross-entropy of ``F.linear(hidden, weight)`` [..., vocab] against ``targets``
    [...], without the logits ([Note: the logits are never whole]); ``targets`` equal to
    ``ignore_index`` count not (all ignored: NaN, as ``F.cross_entropy``).

    Under autocast the operands are cast to autocast's dtype, as ``F.linear`` would be."""
    if hidden.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is "
                        f"{weight.dtype}; cast one of them (or run under autocast)")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    columns = _columns(flat.shape[0], weight.shape[0])
    total, _ = torch.ops.zbuf_fused.linear_cross_entropy(flat, weight, flat_targets, ignore_index,
                                                   columns)
    return total / (flat_targets != ignore_index).sum()


def _operands(node):
    """(backward?, hidden, weight) fake values of the operator at FX ``node``, or None for any
    other node."""
    forward = torch.ops.zbuf_fused.linear_cross_entropy.default
    backward = torch.ops.zbuf_fused.linear_cross_entropy_backward.default
    if node.target not in (forward, backward):
        return None
    first = 1 if node.target is backward else 0
    hidden, weight = (node.args[first + i].meta.get("val") for i in (0, 1))
    if hidden is None or weight is None:
        return None
    return node.target is backward, hidden, weight


def matmul_flops(node) -> float:
    """Matmul FLOPs of the operator at FX ``node`` (0 for any other node): the logits' product
    forward; backward that again, plus ``grad_W``'s and ``grad_h``'s."""
    found = _operands(node)
    if found is None:
        return 0.0
    backward, hidden, weight = found
    product = 2.0 * int(hidden.shape[0]) * int(hidden.shape[1]) * int(weight.shape[0])
    return 3 * product if backward else product


def workspace_bytes(node) -> int:
    """Bytes the operator at FX ``node`` allocates inside and frees before it returns (0 for any
    other node): a vocabulary slice's fp32 logits and its low-precision copy and product, and, in
    backward, the fp32 ``grad_h`` accumulator and one slice's bf16 product of it."""
    found = _operands(node)
    if found is None or not isinstance(node.args[-1], int):
        return 0
    backward, hidden, _weight = found
    columns = node.args[-1]
    tokens, width = int(hidden.shape[0]), int(hidden.shape[1])
    low = hidden.element_size()
    per_slice = tokens * columns * (4 + 2 * low)
    if not backward:
        return per_slice + 3 * tokens * 4
    return per_slice + tokens * width * (4 + low)
