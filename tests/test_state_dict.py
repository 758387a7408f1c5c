"""State dicts of sharded models across world sizes (one 2-rank launch; see [Note: state dict forms]).

A 1-rank subgroup per process stands in for "the same model sharded over another world size", so
a 2-rank checkpoint meets a 1-rank model without a second launch.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from test_shard_parity import ParityNet


def _one_step(model, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 37, (3, 5), generator=g)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()


def _state_dict_worker(rank, world):
    import torch.distributed as dist

    from zbuf.shard import ShardingError, shard
    from zbuf.state_dict import full_state_dict, load_full_state_dict

    def close(a, b):
        assert list(a) == list(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)

    torch.manual_seed(0)
    init = ParityNet()
    a = shard(copy.deepcopy(init))
    _one_step(a, rank)
    full_a = full_state_dict(a)

    # per-rank form: unsharded keys, flat shards, the world size recorded in the metadata
    sd = a.state_dict()
    assert list(sd) == list(init.state_dict())
    assert sd["head.weight"].shape == (-(-37 * 13 // world),)
    assert sd._metadata["embed"]["zbuf_world_size"] == world
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf)  # metadata survives a file

    # same world size: the shards load directly
    b = shard(copy.deepcopy(init))
    b.load_state_dict(sd)
    close(full_state_dict(b), full_a)

    # full form: world-size independent, loads into an unsharded model too
    assert all(k not in m for m in full_a._metadata.values() for k in ["zbuf_world_size"])
    plain = copy.deepcopy(init)
    plain.load_state_dict(full_a)
    close(plain.state_dict(), full_a)
    only0 = full_state_dict(a, rank0_only=True)
    if rank == 0:
        close(only0, full_a)
    else:
        assert only0 == {}

    # another world size (a 1-rank group per process)
    groups = [dist.new_group([r]) for r in range(world)]
    c = shard(copy.deepcopy(init), groups[rank])
    with pytest.raises(ShardingError, match=f"shards from a {world}-rank zbuf.shard.*over 1 ranks.*full_state_dict"):
        c.load_state_dict(sd)
    with pytest.raises(ShardingError, match=f"expects the full tensor.*looks like a shard from a {world}-rank run"):
        load_full_state_dict(c, sd)
    load_full_state_dict(c, full_a)
    close(full_state_dict(c), full_a)
    d = shard(copy.deepcopy(init), groups[rank])
    d.load_state_dict(full_a)  # the plain loader takes full tensors as well
    close(full_state_dict(d), full_a)
    # and the result trains on: grads flow after a load
    _one_step(d, rank)
    assert d.embed._parameters["weight"].grad is not None
    with pytest.raises(ShardingError, match="not the root of a zbuf.shard call"):
        full_state_dict(d.blocks)
    return True


def test_state_dict_forms_and_world_size_mismatch():
    assert run_distributed(_state_dict_worker, 2) == [True, True]
