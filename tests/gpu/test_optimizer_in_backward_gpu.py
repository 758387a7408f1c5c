"""The optimizer step in backward on CUDA under Inductor ([Note: optimizer in backward] in
zbuf/optimizer_in_backward.py): the backward runs on autograd's device thread and Inductor
compiles the graph that returns no gradient shards. Same parameters as stepping after backward.
(The memory a step saves is measured by benches/memfloor.py on qwen3-1.7b:
benches/results/floor17b.md.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.cuda

STEPS = 3


def _run(base, in_backward: bool, batches):
    import zbuf
    import zbuf.compile
    from zbuf.models import loss
    from zbuf.shard import shard

    torch._dynamo.reset()
    model = shard(copy.deepcopy(base).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # From lr 0: Adam's first step is a sign step that turns rounding differences of
    # near-zero gradients (two Inductor graphs) into lr-sized ones ([Note: first Adam step]).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
    cm = zbuf.compile(model, optimizer=opt, optimizer_in_backward=in_backward, fullgraph=True,
                      inner="inductor")
    for tokens, targets in batches:
        value = loss(cm, tokens, targets)
        value.backward()
        if in_backward:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    zbuf.compile.step_memory_of(cm).detach()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_in_backward_on_cuda_matches_stepping_after_it():
    from zbuf.models import build_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    base = build_model("tiny")
    g = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    batches = [(torch.randint(0, vocab, (4, 64), generator=g).cuda(),
                torch.randint(0, vocab, (4, 64), generator=g).cuda()) for _ in range(STEPS)]
    after = _run(base, False, batches)
    during = _run(base, True, batches)
    for p, q in zip(during, after):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
