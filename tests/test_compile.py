"""The zbuf compile backend in one process (world size 1, gloo): rewrite, parity, order, report.

Multi-rank behaviour (parity at 2 and 3 ranks, mismatch detection) is in test_compile_dist.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zbuf.ops as zops
from zbuf.compile import CompileOptions, ScheduleMismatchError, collectives, schedule_report
from zbuf.compile.backend import zbuf_backend
from zbuf.compile.fingerprint import _first_difference
from zbuf.compile.report import clear_records

VOCAB, DIM, HIDDEN = 23, 12, 20


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        created = True
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    clear_records()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """Tied embedding/head (one parameter read at both ends), a checkpointed block."""

    def __init__(self, n_blocks: int = 3, ckpt: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.ckpt = ckpt

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt and i == 1 else b(x)
        return self.head(x)


def _batches(n=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g)) for _ in range(n)]


def _train(model, step_fn, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, per_step = [], []
    pool_misses = []
    from zbuf.pool import default_pool

    pool = default_pool("cpu")
    for tokens, targets in batches:
        before = zops.counters["all_gather"]
        misses = pool.stats().misses
        loss = F.cross_entropy(step_fn(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        per_step.append(zops.counters["all_gather"] - before)
        pool_misses.append(pool.stats().misses - misses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, per_step, pool_misses


def _sharded_pair():
    from zbuf.shard import shard

    torch.manual_seed(0)
    init = Net()
    eager = shard(Net())
    eager.load_state_dict(init.state_dict())
    compiled = shard(Net())
    compiled.load_state_dict(init.state_dict())
    return eager, compiled


def test_options_are_validated():
    with pytest.raises(ValueError, match="unknown zbuf compile option"):
        CompileOptions.from_mapping({"budget": 3})
    with pytest.raises(ValueError, match="budget_bytes"):
        CompileOptions(budget_bytes=-1)
    with pytest.raises(ValueError, match="inner"):
        CompileOptions(inner="eager")
    with pytest.raises(ValueError, match="persist_fraction"):
        CompileOptions(persist_fraction=1.5)
    with pytest.raises(ValueError, match="takes no mode"):
        zbuf_backend(None, [], mode="max-autotune")
    assert CompileOptions().digest() != CompileOptions(prefetch=False).digest()


PLANS = {
    # A budget below the floor is raised to it: re-gathers between distant uses (tied weight).
    "floor_budget": dict(budget_bytes=1, persist=False),
    "coalesced": dict(persist=False, coalesce=True),
    "persist_all": dict(persist=True, persist_fraction=1.0),
    "serial": dict(prefetch=False, coalesce=False, persist=False),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_aot_eager_matches_eager_and_gathers_only_what_it_planned(plan):
    eager, model = _sharded_pair()
    batches = _batches()
    ref_losses, _, _ = _train(eager, eager, batches)
    cm = torch.compile(model, backend="zbuf", options=dict(inner="aot_eager", **PLANS[plan]), fullgraph=True)
    losses, per_step, misses = _train(model, cm, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    for (k, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")

    recs = schedule_report(model)
    assert [r.kind for r in recs] == ["forward", "backward"]
    fw, bw = recs
    # Guard evaluation and everything else outside the graphs gather nothing: every gather of a
    # step is one the plan made.
    assert per_step[1:] == [fw.gather_calls + bw.gather_calls] * (len(batches) - 1)
    # The pool was sized from the plan: after the first step no gather allocates.
    assert misses[1:] == [0] * (len(misses) - 1), misses
    assert collectives.pending() == 0
    for r in recs:
        assert r.peak_live_gathered_bytes <= r.budget_bytes
        assert r.fingerprint and r.planning_seconds >= 0 and r.collectives > 0
    if plan == "floor_budget":
        assert fw.budget_bytes == fw.floor_bytes and fw.requested_budget_bytes == 1
        assert fw.regathers + bw.regathers > 0
    if plan == "coalesced":
        assert fw.coalesced_groups > 0 and fw.collectives < fw.gather_calls
    if plan == "persist_all":
        # Every weight backward reads is kept (the checkpointed block's bias too, its recompute
        # reads it); backward gathers only for the embedding lookup the partitioner chose to
        # recompute. Biases outside the checkpointed block are not read by backward: not kept.
        assert 0 < fw.persistent < fw.gathers and bw.gather_calls == 1
        assert bw.persistent_bytes > 0
    else:
        assert fw.persistent == 0 and bw.gather_calls > 0
    if plan == "serial":
        assert fw.prefetched == 0 and bw.prefetched == 0 and fw.coalesced_groups == 0
    else:
        assert fw.prefetched > 0


def _zbuf_calls(code: str) -> list[str]:
    """Every zbuf op called by generated code, in order."""
    return re.findall(r"torch\.ops\.zbuf\.(\w+)\.default\(", code)


def test_inductor_code_keeps_the_planned_order():
    from torch._inductor.utils import run_and_get_code
    from zbuf.shard import shard

    torch.manual_seed(0)
    model = shard(Net(n_blocks=2, ckpt=False))
    cm = torch.compile(model, backend="zbuf", options=dict(persist=False, coalesce=False), fullgraph=True)
    tokens, targets = _batches(1)[0]

    def step():
        F.cross_entropy(cm(tokens).flatten(0, 1), targets.flatten()).backward()

    _, codes = run_and_get_code(step)
    fw, bw = schedule_report(model)
    assert len(codes) == 2
    for code, rec in zip(codes, (fw, bw)):
        in_code = _zbuf_calls(code)
        assert in_code == list(rec.op_order)
        # Prefetch survived Inductor's scheduling: some started gathers wait only after compute
        # kernels that the plan put between start and wait.
        lines = code.splitlines()
        overlapped = 0
        for i, line in enumerate(lines):
            m = re.search(r"zbuf\.all_gather_start\.default\(buf\d+, \[(\w+)", line)
            if not m:
                continue
            wait = next(j for j in range(i, len(lines)) if f"all_gather_wait.default(buf0, [{m.group(1)}" in lines[j])
            overlapped += any(("extern_kernels." in ln or "cpp_fused" in ln) for ln in lines[i:wait])
        # (The very first gather has nothing to hide behind but the graph's inputs.)
        assert overlapped >= rec.prefetched - 1 > 0


def test_schedule_log_writes_json_lines(tmp_path, monkeypatch):
    log = tmp_path / "schedule.jsonl"
    monkeypatch.setenv("ZBUF_LOG", "schedule")
    monkeypatch.setenv("ZBUF_LOG_FILE", str(log))
    _, model = _sharded_pair()
    cm = torch.compile(model, backend="zbuf", options=dict(inner="aot_eager"))
    _train(model, cm, _batches(1))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["forward", "backward"]
    for r in lines:
        for key in ("graph_id", "budget_bytes", "peak_live_gathered_bytes", "gathers",
                    "coalesced_groups", "prefetched", "persistent", "fingerprint", "planning_seconds"):
            assert key in r


def test_schedule_report_is_per_model():
    _, a = _sharded_pair()
    _, b = _sharded_pair()
    for m in (a, b):
        _train(m, torch.compile(m, backend="zbuf", options=dict(inner="aot_eager")), _batches(1))
    ra, rb = schedule_report(a), schedule_report(b)
    assert len(ra) == len(rb) == 2 and not set(ra) & set(rb)
    assert len(schedule_report()) == 4


def test_mismatch_message_names_the_first_difference():
    mine = json.dumps(["zbuf::all_gather_start[a]", "zbuf::reduce_scatter[b]"])
    other = json.dumps(["zbuf::all_gather_start[a]", "zbuf::all_gather_start[c]", "x"])
    msg = _first_difference([mine, other], 0)
    assert "collective #1" in msg and "reduce_scatter[b]" in msg and "rank 1" in msg
    assert issubclass(ScheduleMismatchError, RuntimeError)


def test_zbuf_compile_agrees_on_free_memory_and_trains():
    import zbuf.compile
    from zbuf.compile import budget

    eager, model = _sharded_pair()
    batches = _batches(2)
    ref_losses, _, _ = _train(eager, eager, batches)
    cm = zbuf.compile(model, inner="aot_eager", persist=False)
    group = dist.group.WORLD.group_name
    agreed = budget.agreed_free_memory(group)
    assert agreed is not None and agreed > 0
    losses, _, _ = _train(model, cm, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    fw, bw = schedule_report(model)
    # The budget derives from the agreed free memory minus the graph's activation peak.
    expected = int(agreed * (1 - CompileOptions().margin_fraction)) - fw.activation_peak_bytes
    assert fw.budget_bytes == max(expected, fw.floor_bytes)
    with pytest.raises(TypeError):
        zbuf.compile(model, no_such_option=1)
