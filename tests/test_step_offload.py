"""The optimizer's state offloaded for a step after backward ([Note: optimizer state offloaded
after backward] in zbuf/optimizer_step_offload.py): the schedule's order, the bucket plan, the
bytes each step moves, and the same updates bit for bit as the state kept on the device. On CPU
the host copies are separate tensors and every copy is made; only the overlap needs a GPU."""

import contextlib
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zbuf.optimizer_step_offload import StepOffload, plan_buckets, step_schedule

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))


# -- the schedule (pure) -----------------------------------------------------------------------

@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(buckets=st.integers(0, 30), slots=st.integers(1, 4))
def test_schedule_steps_each_bucket_once_between_its_upload_and_download(buckets, slots):
    slot_holds: dict[int, int] = {}  # slot -> the bucket in it
    stepped, downloaded, uploaded = [], set(), []
    for op in step_schedule(buckets, slots):
        assert op.slot == op.bucket % slots  # a bucket always uses the same slot
        if op.kind == "upload":
            # A slot is rewritten only once the bucket it held went back to the host.
            assert slot_holds.get(op.slot) in (None, *downloaded)
            slot_holds[op.slot] = op.bucket
            uploaded.append(op.bucket)
        elif op.kind == "step":
            assert slot_holds.get(op.slot) == op.bucket, "stepped before its upload"
            stepped.append(op.bucket)
        else:
            assert stepped[-1] == op.bucket, "downloaded before its step"
            downloaded.add(op.bucket)
        assert len(set(uploaded) - downloaded) <= slots  # what is on the device at once
    assert stepped == uploaded == list(range(buckets))
    assert downloaded == set(range(buckets))


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 100)), max_size=30)
       .map(lambda xs: sorted(xs, key=lambda x: x[0])),
       resident=st.integers(0, 400), bucket=st.integers(1, 250))
def test_bucket_plan_keeps_a_prefix_and_cuts_the_rest_in_order(sizes, resident, bucket):
    kept, buckets = plan_buckets(sizes, resident, bucket)
    assert kept == list(range(len(kept)))
    assert sum(sizes[i][1] for i in kept) <= resident
    if len(kept) < len(sizes):  # the next one did not fit
        assert sum(sizes[i][1] for i in kept) + sizes[len(kept)][1] > resident
    assert [i for b in buckets for i in b] == list(range(len(kept), len(sizes)))
    for b in buckets:
        assert len({sizes[i][0] for i in b}) == 1, "a bucket spans two groups"
        # Closed by the parameter that reached the size, or by its group's (or the list's) end.
        assert sum(sizes[i][1] for i in b[:-1]) < bucket
        last = b[-1]
        ends_group = last + 1 == len(sizes) or sizes[last + 1][0] != sizes[last][0]
        assert ends_group or sum(sizes[i][1] for i in b) >= bucket


# -- the executor on CPU -----------------------------------------------------------------------

SHAPES = [(37,), (16, 8), (5, 3), (64,), (9,), (12, 12)]


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _optimizer(kind, params):
    groups = [{"params": params[:4]}, {"params": params[4:], "lr": 3e-2}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=kind == "adamw-fused")


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _train(kind, steps, offload_args=None, seed=0):
    params = _params(seed)
    opt = _optimizer(kind, params)
    off = StepOffload(opt, torch.device("cpu"), **offload_args) if offload_args else None
    for step in range(steps):
        _grads(params, step)
        opt.step()
        opt.zero_grad()
    return params, opt, off


def _state_equal(a, b, params_a, params_b):
    for pa, pb in zip(params_a, params_b):
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


@settings(max_examples=max(10, MAX_EXAMPLES // 10), deadline=None)
@given(kind=st.sampled_from(["adamw", "adamw-fused", "sgd"]), resident=st.integers(0, 3000),
       bucket=st.integers(1, 1500), steps=st.integers(1, 4))
def test_offloaded_step_is_bit_exact_against_the_state_on_the_device(kind, resident, bucket,
                                                                      steps):
    ref, ref_opt, _ = _train(kind, steps)
    got, opt, off = _train(kind, steps, {"resident_bytes": resident, "bucket_bytes": bucket})
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt, ref, got)
    # Between steps the streamed state is in the host copies, the resident state is not.
    arena = None if off._arena is None else off._arena.memory
    streamed = {id(p) for b in off.buckets for p in b.params}
    for p in got:
        for k, v in opt.state[p].items():
            if v.dim() == 0:
                continue
            in_arena = (arena is not None and arena.data_ptr() <= v.data_ptr()
                        < arena.data_ptr() + arena.numel())
            assert in_arena == (id(p) in streamed), (k, p.shape)


def test_each_step_moves_the_streamed_state_once_each_way():
    per_param = [2 * 4 * torch.Size(s).numel() for s in SHAPES]  # AdamW: two fp32 moments
    resident = per_param[0] + per_param[1]
    _, opt, off = _train("adamw", 4, {"resident_bytes": resident, "bucket_bytes": 300})
    # 120 B + 512 B close the first bucket; 72 B + 1152 B, the second group's, the second.
    assert [len(b.params) for b in off.buckets] == [2, 2]
    streamed = sum(b.used for b in off.buckets)
    assert streamed >= sum(per_param[2:])  # aligned copies of each moment
    first, *steady = off.records
    # Step 0 makes the state: nothing to upload.
    assert first.downloaded_bytes == streamed and first.uploaded_bytes == 0
    for r in steady:
        assert r.uploaded_bytes == r.downloaded_bytes == streamed
    rep = off.report()
    assert rep["bytes_moved_per_step"] == 2 * streamed
    assert rep["resident_state_bytes"] == resident
    assert rep["device_slot_bytes"] == 2 * max(b.capacity for b in off.buckets)
    assert off.slots == []  # made for the step only


def test_the_executor_runs_the_schedule_in_order(monkeypatch):
    params = _params(0)
    opt = _optimizer("adamw", params)
    off = StepOffload(opt, torch.device("cpu"), bucket_bytes=50)
    done = []
    for kind in ("upload", "step_bucket", "download"):
        real = getattr(off, f"_{kind}")
        monkeypatch.setattr(off, f"_{kind}", lambda i, s, real=real, kind=kind: (
            done.append((kind.replace("_bucket", ""), i, s)), real(i, s)))
    for step in range(2):
        _grads(params, step)
        opt.step()
    n = len(off.buckets)
    assert n == 6
    assert done == [tuple(op) for op in step_schedule(n) * 2]


def test_state_dict_round_trip_continues_bit_exact():
    ref, ref_opt, _ = _train("adamw", 5)
    params, opt, off = _train("adamw", 3, {"bucket_bytes": 400})
    saved = {k: v for k, v in opt.state_dict().items()}
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _optimizer("adamw", params2)
    off2 = StepOffload(opt2, torch.device("cpu"), bucket_bytes=400)
    opt2.load_state_dict(saved)
    assert all(b.used for b in off2.buckets)  # the loaded state went to the host copies
    for step in (3, 4):
        _grads(params2, step)
        opt2.step()
    for a, b in zip(ref, params2):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt2, ref, params2)


def test_loading_never_moves_the_streamed_state_to_the_parameters_device(monkeypatch):
    """[Note: loading streamed state]: torch's load puts every state tensor it is given on its
    parameter's device; the streamed state must go to the host regions without that trip (at
    qwen3-32b, 32.8 GB on the device at once)."""
    params, opt, off = _train("adamw", 3, {"bucket_bytes": 400})
    saved = opt.state_dict()
    given = {id(v) for st in saved["state"].values() for v in st.values()}
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _optimizer("adamw", params2)
    off2 = StepOffload(opt2, torch.device("cpu"), bucket_bytes=400)
    moved = []
    real = torch.optim.Optimizer._process_value_according_to_param_policy
    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy",
                        staticmethod(lambda param, value, *a: (moved.append((param, a[-1])),
                                                               real(param, value, *a))[1]))
    opt2.load_state_dict(saved)
    streamed = {id(p) for b in off2.buckets for p in b.params}
    assert streamed and not [k for p, k in moved if id(p) in streamed and k != "step"], moved
    assert {id(v) for st in saved["state"].values() for v in st.values()} == given  # untouched
    assert off2.host_held_bytes() == sum(v.numel() * v.element_size()
                                         for p in params2 if id(p) in streamed
                                         for k, v in opt2.state[p].items() if k != "step")
    for step in (3, 4):
        _grads(params2, step)
        opt2.step()
    ref, ref_opt, _ = _train("adamw", 5)
    for a, b in zip(ref, params2):
        assert torch.equal(a, b)


def test_inactive_offload_changes_nothing_and_turns_on_over_existing_state():
    """A resumed run loads its state before step 0 decides where it lives: turned on then, the
    offload moves that state to the host and the steps go on bit for bit (at 4d62ab8 it
    refused, and a resume with the plan's offload failed at step 0)."""
    ref, ref_opt, _ = _train("adamw", 4)
    params, opt, off = _train("adamw", 2, {"active": False, "bucket_bytes": 400})
    assert not off.active and off.records == []
    for a, b in zip(_train("adamw", 2)[0], params):
        assert torch.equal(a, b)
    off.activate(0)
    streamed = {id(p) for b in off.buckets for p in b.params}
    assert streamed and off.host_held_bytes() == sum(
        v.numel() * v.element_size() for p in params if id(p) in streamed
        for k, v in opt.state[p].items() if k != "step")
    for step in (2, 3):
        _grads(params, step)
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref, params):
        assert torch.equal(a, b)
    _state_equal(ref_opt, opt, ref, params)


def test_more_state_than_the_policy_knows_is_one_clear_error():
    params = _params(0)
    opt = torch.optim.AdamW(params, amsgrad=True)  # a third moment, max_exp_avg_sq
    StepOffload(opt, torch.device("cpu"))
    _grads(params, 0)
    with pytest.raises(RuntimeError, match="STATE_COPIES or drop offload_optimizer"):
        opt.step()


# -- zbuf.compile(model, optimizer=opt): the user's loop -----------------------------------------

def _plain_run(offload, steps=3, free=None, resumed_after=0, **options):
    """The plain user setup on a small decoder (one compiled frame per block): ``steps`` of
    ``loss.backward(); opt.step()``; returns the losses, the parameters, the offload's record and
    the state's bytes. ``free(gradient bytes)``: the free memory every rank agrees on at compile
    time (default: the host's). ``resumed_after``: steps taken eagerly before the compile, as a
    resumed run's optimizer holds its state before its first compiled step."""
    import copy

    import zbuf
    import zbuf.compile
    from zbuf.models import ModelConfig, build_model, loss
    from zbuf.memory import OptimizerPolicy
    from zbuf.shard import shard

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, ffn_hidden_size=96, rope_theta=10_000.0)
    model = shard(copy.deepcopy(build_model(cfg)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    before = torch.Generator().manual_seed(5)
    for _ in range(resumed_after):
        tokens = torch.randint(0, 97, (2, 9), generator=before)
        loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    agreed = contextlib.nullcontext()
    if free is not None:
        total = free(sum(p.numel() * 4 for p in model.parameters()))
        agreed = mock.patch("zbuf.compile.compiled_model.agree_free_memory",
                            lambda group, device=None, reserve_bytes=0: total - reserve_bytes)
    with agreed:
        cm = zbuf.compile(model, optimizer=opt, inner="aot_eager", offload_optimizer=offload,
                          **options)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 97, (2, 9), generator=g)
        out = loss(cm, tokens[:, :-1], tokens[:, 1:])
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    memory = zbuf.compile.step_memory_of(cm)
    report = memory.report()
    if report["optimizer_offload"] is not None:
        report["optimizer_offload"]["measured_step"] = memory.measured_step
    memory.detach()
    params = [p.detach().clone() for p in model.parameters()]
    state = OptimizerPolicy.of(opt).state_bytes(model.parameters())
    return losses, params, report["optimizer_offload"], state


@pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")
def test_plain_loop_with_the_state_offloaded_trains_bit_exact(monkeypatch):
    """``zbuf.compile(model, optimizer=opt, offload_optimizer=True)`` with the user's
    ``opt.step()`` after backward: the losses and parameters of the state kept on the device,
    bit for bit, and the record says what moved."""
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)  # several buckets
    kept = _plain_run(False)
    moved = _plain_run(True)
    assert moved[0] == kept[0]
    for a, b in zip(kept[1], moved[1]):
        assert torch.equal(a, b)
    assert kept[2] is None  # False: no offload installed at all
    rec, state = moved[2], moved[3]
    assert rec["chosen_by"] == "user" and rec["active"] and rec["buckets"] > 2
    assert rec["offloaded_state_bytes"] >= state and rec["resident_state_bytes"] == 0
    assert rec["bytes_moved_per_step"] >= 2 * state
    assert [s["downloaded_bytes"] for s in rec["steps"]] == [rec["bytes_moved_per_step"] // 2] * 3
    assert [s["uploaded_bytes"] for s in rec["steps"]] == [0] + [rec["bytes_moved_per_step"] // 2] * 2


@pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")
def test_the_plan_offloads_the_state_when_the_step_would_not_fit(monkeypatch):
    """[Note: offloading when the step does not fit]: on an emulated card too small for the
    state beside step 0's peak, the plan offloads it by itself, says so in the record, and
    trains the same; on a card that holds it, nothing moves."""
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)
    roomy = _plain_run(None, free_memory_bytes=1 << 30)
    state = roomy[3]
    assert roomy[2]["chosen_by"] is None and not roomy[2]["active"]
    assert roomy[2]["measured"]["state_bytes"] == state
    small = _plain_run(None, free_memory_bytes=state + state // 2)
    rec = small[2]
    assert rec["chosen_by"] == "plan" and rec["active"], rec
    assert "step 0 peaked at" in rec["why"] and "in host memory" in rec["why"]
    assert rec["measured"]["peak_bytes"] + state > rec["measured"]["usable_bytes"]
    assert 0 < rec["offloaded_state_bytes"] and rec["resident_state_bytes"] < state
    assert small[0] == roomy[0]
    for a, b in zip(roomy[1], small[1]):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")
def test_a_resumed_run_offloads_its_loaded_state_and_measures_the_step_after(monkeypatch):
    """A resumed run's optimizer holds its state before step 0 decides where it lives: the plan
    moves it to the host then, and step 1, the first without it on the device, is the step
    measured (at 4d62ab8 the offload refused to turn on over existing state, and `zbuf train
    --resume` on a card the plan offloads for failed at step 0)."""
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)
    roomy = _plain_run(None, resumed_after=2, free_memory_bytes=1 << 30)
    state = roomy[3]
    assert roomy[2]["chosen_by"] is None and roomy[2]["measured_step"] == 0
    small = _plain_run(None, resumed_after=2, free_memory_bytes=state + state // 2)
    rec = small[2]
    assert rec["chosen_by"] == "plan" and rec["active"] and rec["measured_step"] == 1, rec
    assert 0 < rec["offloaded_state_bytes"]
    assert small[0] == roomy[0]
    for a, b in zip(roomy[1], small[1]):
        assert torch.equal(a, b)


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(usable=st.integers(1, 10**6), peak=st.integers(0, 10**6), start=st.integers(0, 10**6),
       state=st.integers(0, 10**6), fraction=st.sampled_from([0.0, 0.5, 1.0]),
       slots=st.integers(0, 10**5), frag=st.sampled_from([0, 1, 250_000, 1_000_000]))
def test_the_plan_keeps_on_the_device_the_most_state_that_fits(usable, peak, start, state,
                                                                fraction, slots, frag):
    """[Note: offloading when the step does not fit]: the whole state stays if it fits beside
    step 0's peak and in the optimizer's own step; else the most that fits both (in the step
    beside the slots). What stays, and its temporaries, fragment the allocator as step 0 did
    ([Note: the state placed beside the measured fragmentation]): they take one plus the
    fragmentation times their bytes, and no other margin."""
    from zbuf.memory.ledger import PPM
    from zbuf.offload_choice import place_state

    def taken(nbytes):  # what putting ``nbytes`` there takes of the memory
        return nbytes * (PPM + frag) / PPM

    place = place_state(usable, peak, start, state, fraction, slots, frag)
    whole = (peak + taken(state) <= usable
             and start + taken(state * (1 + fraction)) <= usable)
    assert place.fits == whole
    if whole:
        assert place.resident_bytes == state
        return

    def fits(r):
        return peak + taken(r) <= usable and start + slots + taken(r * (1 + fraction)) <= usable

    r = place.resident_bytes
    assert 0 <= r <= state
    assert r == 0 or fits(r)
    assert r == state or not fits(r + 1)


@pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")
def test_a_state_that_cannot_fit_beside_the_gradients_is_planned_without_and_placed_at_step_0(
        monkeypatch):
    """[Note: offloading when the step does not fit], expected at compile time: with AdamW's
    state reserved, the free memory cannot hold the gradients (g) and foreach's step temporaries
    (g), so step 0's graphs are planned without it (no refusal), and step 0 offloads what does
    not fit, said in the record; the same training."""
    import zbuf.compile.compiled_model as cmod
    import zbuf.offload_choice

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)
    monkeypatch.setattr(cmod, "BUCKET_BYTES", 8 << 10)
    kept = _plain_run(False)
    from zbuf.compile.budget import PlanExceedsMemoryError

    with pytest.raises(PlanExceedsMemoryError, match="refusing a step that cannot fit"):
        _plain_run(False, free=lambda g: 4 * g - 1)  # state 2g + gradients g + temporaries g
    moved = _plain_run(None, free=lambda g: 4 * g - 1)
    rec = moved[2]
    assert rec["chosen_by"] == "plan" and rec["active"], rec
    assert rec["why"].startswith("at compile time") and "step 0 peaked at" in rec["why"]
    assert rec["offloaded_state_bytes"] > 0
    assert moved[0] == kept[0]
    for a, b in zip(kept[1], moved[1]):
        assert torch.equal(a, b)
