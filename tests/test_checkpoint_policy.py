"""SaveResumePolicy: what ``zbuf train --checkpoint-dir D --save-every N --resume`` does per step.

In this process on a one-rank gloo group; the multi-rank, fresh-process resume is in
test_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zbuf.checkpoint as ckpt
from zbuf.train.save_resume import SaveResumePolicy


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


def _make():
    from zbuf.shard import shard

    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 2)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # data is a function of the step, as in zbuf.train
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run(policy: SaveResumePolicy, total: int, stop_after=None):
    model, opt = _make()
    start = policy.resume_step(model, opt)
    for step in range(start, total if stop_after is None else stop_after):
        _step(model, opt, step)
        policy.after_step(step + 1, model, opt)
    return start, model, opt


def _flat(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [st[k].clone() for k in sorted(st)]
    return out


def test_save_every_prune_and_bit_exact_resume(tmp_path):
    root = tmp_path / "ck"
    policy = SaveResumePolicy(directory=str(root), save_every=2, resume=True, keep_last=2)

    _, ref_model, ref_opt = _run(SaveResumePolicy(), 7)  # no checkpoints at all
    assert not root.exists()

    start, _, _ = _run(policy, 7, stop_after=5)  # "killed" after step 5
    assert start == 0
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 4]

    start, model, opt = _run(policy, 7)  # the restart: same command line
    assert start == 4
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4, 6]
    a, b = _flat(ref_model, ref_opt), _flat(model, opt)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_resume_without_checkpoints_starts_fresh(tmp_path):
    policy = SaveResumePolicy(directory=str(tmp_path / "empty"), resume=True)
    model, opt = _make()
    assert policy.resume_step(model, opt) == 0
    assert policy.after_step(3, model, opt) is None  # no save_every: never saves


def test_disabled_policy_does_nothing(tmp_path):
    model, opt = _make()
    policy = SaveResumePolicy()
    assert not policy.enabled
    assert policy.resume_step(model, opt) == 0 and policy.after_step(10, model, opt) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"save_every": 5}, "need --checkpoint-dir"),
        ({"resume": True}, "need --checkpoint-dir"),
        ({"directory": "d", "save_every": 0}, "save_every must be a positive int"),
        ({"directory": "d", "save_every": True}, "save_every must be a positive int"),
        ({"directory": "d", "keep_last": 0}, "keep_last must be an int >= 1"),
        ({"directory": "d", "resume": "yes"}, "resume must be a bool"),
        ({"directory": ""}, "checkpoint directory must be a path"),
    ],
)
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SaveResumePolicy(**kwargs)
