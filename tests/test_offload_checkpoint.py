"""``zbuf.load_checkpoint`` into an optimizer whose state is streamed ([Note: loading streamed
state] in zbuf/optimizer_step_offload.py): the streamed state is read straight into the host
regions, never onto the device; a resume whose offload the plan decides later holds no state on
the device before the step that decides; and training goes on bit for bit as the uninterrupted
run. On CPU the device is the host, so "on the device" is what the CPU stand-in counts: state
tensors outside the offload's host arena (``PhaseMeter.tracked_bytes``)."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import zbuf.checkpoint as ckpt
from zbuf.checkpoint import layout
from zbuf.optimizer_step_offload import StepOffload

pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


def _make(offload=None):
    from zbuf.shard import shard

    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(),
                                nn.Linear(30, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    off = None if offload is None else StepOffload(opt, torch.device("cpu"), bucket_bytes=600,
                                                   **offload)
    return model, opt, off


def _step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_bytes(opt, where=lambda v: True) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() and where(v))


def _in(arena):
    lo = arena.data_ptr()
    return lambda v: lo <= v.data_ptr() < lo + arena.numel()


def _flat(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        out += [torch.as_tensor(st[k]).clone() for k in sorted(st)]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@contextlib.contextmanager
def _read_onto_the_device(record):
    """Records the bytes of optimizer state that the checkpoint reader reads outside the
    offload's host regions (the device, on a GPU): its DCP destinations."""
    real = layout.optimizer_destinations

    def spy(*args, **kwargs):
        dest = real(*args, **kwargs)
        record.extend(t for per in dest.values() for t in per.values()
                      if isinstance(t, torch.Tensor) and t.dim())
        return dest

    layout.optimizer_destinations = spy
    try:
        yield
    finally:
        layout.optimizer_destinations = real


@pytest.mark.parametrize("resident", [0, 2500])
def test_the_streamed_state_is_read_straight_into_the_host_regions(tmp_path, resident):
    """At 5737205 the reader read every state tensor into a fresh tensor on the model's device
    before ``load_state_dict`` moved the streamed ones to the host: the whole state on the
    device at once, at the resume of a run offloaded because it does not fit."""
    reference, ref_opt, _ = _make()
    for step in range(5):
        _step(reference, ref_opt, step)
    model, opt, _ = _make({"resident_bytes": resident})
    for step in range(3):
        _step(model, opt, step)
    ckpt.save_checkpoint(tmp_path / "c", model, opt, step=3)

    model, opt, off = _make({"resident_bytes": resident})
    read = []
    with _read_onto_the_device(read):
        ckpt.load_checkpoint(tmp_path / "c", model, opt)
    host = _in(off._arena.memory)
    assert len(off.buckets) > 1 and (off.resident_bytes > 0) == (resident > 0)
    # Read: the streamed state into the regions, only the resident state anywhere else.
    assert sum(t.numel() * t.element_size() for t in read if not host(t)) == off.resident_bytes
    streamed = sum(t.numel() * t.element_size() for t in read if host(t))
    # Loaded: the same split, the streamed state tensors the regions' own.
    assert streamed > 0 and off.host_held_bytes() == _state_bytes(opt, host) == streamed
    assert _state_bytes(opt, lambda v: not host(v)) == off.resident_bytes
    for step in (3, 4):
        _step(model, opt, step)
    _assert_same(_flat(reference, ref_opt), _flat(model, opt))


def test_an_undecided_offload_holds_the_loaded_state_on_the_host_until_the_step(tmp_path):
    """[Note: loading streamed state], undecided: none of the loaded state is on the device
    before the next step begins, where the memory owner has decided (offloaded: the regions and
    the resident part on the device; kept: all of it on the device); ``state_dict`` in between
    is the checkpoint's; the steps go on bit for bit either way."""
    reference, ref_opt, _ = _make()
    for step in range(5):
        _step(reference, ref_opt, step)
    model, opt, _ = _make()
    for step in range(3):
        _step(model, opt, step)
    ckpt.save_checkpoint(tmp_path / "c", model, opt, step=3)
    saved = copy.deepcopy(opt.state_dict())

    for decision in (None, 0, 2500):  # kept on the device; offloaded, with some resident
        model, opt, _ = _make()
        offload = []
        if decision is not None:  # the memory owner's step pre-hook, before the offload's
            def decide(*_args, resident=decision):
                if not offload[0].active:
                    offload[0].activate(resident)

            opt.register_step_pre_hook(decide)
        off = StepOffload(opt, torch.device("cpu"), bucket_bytes=600, active=False)
        offload.append(off)
        read = []
        with _read_onto_the_device(read):
            ckpt.load_checkpoint(tmp_path / "c", model, opt)
        assert read and all(t.device.type == "cpu" for t in read)  # host tensors, not the device's
        assert _state_bytes(opt) == 0, decision  # none in the optimizer, none on the device
        now = opt.state_dict()
        assert now["state"].keys() == saved["state"].keys()
        for i, st in saved["state"].items():
            assert now["state"][i].keys() == st.keys()
            for k, v in st.items():
                assert torch.equal(now["state"][i][k], v), (i, k)
        for step in (3, 4):
            _step(model, opt, step)
        if decision is None:
            assert not off.active and off.host_held_bytes() == 0
        else:
            assert off.active and off.host_held_bytes() > 0
            assert _state_bytes(opt, lambda v: not _in(off._arena.memory)(v)) == off.resident_bytes
        _assert_same(_flat(reference, ref_opt), _flat(model, opt))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_resume_that_the_plan_offloads_decides_as_the_uninterrupted_run(tmp_path, monkeypatch):
    """``zbuf.compile(model, optimizer=opt)`` (the plan decides at step 0) on a card too small
    for the state beside the step, resumed from a checkpoint: the resumed run's first step runs
    forward and backward without the state, so the plan decides on the numbers the
    uninterrupted run decided on and keeps the same state on the device, and its first step is
    measured as that run's was. At 5737205 the state was on the device through the first
    step's forward and backward, the decision saw it held, and the step after was measured;
    on a card that fits the state only offloaded, that step ran out of memory."""
    import zbuf
    import zbuf.compile
    import zbuf.offload_choice
    from zbuf.models import ModelConfig, build_model, loss
    from zbuf.memory import OptimizerPolicy
    from zbuf.shard import shard

    monkeypatch.setattr(zbuf.offload_choice, "BUCKET_BYTES", 8 << 10)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, ffn_hidden_size=96, rope_theta=10_000.0)
    torch.manual_seed(0)
    base = build_model(cfg)
    batches = [torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(s))
               for s in range(4)]

    def run(steps, load=None, save=None):
        torch._dynamo.reset()
        model = shard(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        state = OptimizerPolicy.of(opt).state_bytes(model.parameters())
        cm = zbuf.compile(model, optimizer=opt, inner="aot_eager",
                          free_memory_bytes=state + state // 2)
        memory = zbuf.compile.step_memory_of(cm)
        held = []
        if load is not None:
            ckpt.load_checkpoint(load, model, opt)
        for tokens in batches[steps.start:steps.stop]:
            held.append(memory.meter.tracked_bytes())  # parameters and any state, before forward
            loss(cm, tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        if save is not None:
            ckpt.save_checkpoint(save, model, opt, step=steps.stop)
        rec = dict(memory.report()["optimizer_offload"], measured_step=memory.measured_step)
        memory.detach()
        return _flat(model, opt), rec, held

    whole, rec, held = run(range(0, 4))
    assert rec["chosen_by"] == "plan" and 0 < rec["offloaded_state_bytes"], rec
    run(range(0, 2), save=tmp_path / "c")
    resumed, rec2, held2 = run(range(2, 4), load=tmp_path / "c")
    _assert_same(whole, resumed)
    # What the resumed run holds beyond the uninterrupted one, before its first forward and as
    # the decision measures it: AdamW's scalar ``step`` counts (kept on the host by torch, off
    # the device), none of the parameter-shaped state.
    scalars = 4 * (len(whole) // 4)  # fp32, one per parameter (of its four tensors in _flat)
    assert held2[0] - held[0] == scalars
    assert rec2["measured"]["step_start_bytes"] - rec["measured"]["step_start_bytes"] == scalars
    assert rec2["chosen_by"] == "plan" and 0 < rec2["offloaded_state_bytes"], rec2
    assert rec2["measured_step"] == rec["measured_step"]  # its first step measured, as fresh


def test_a_host_tensor_stays_in_host_memory_in_the_checkpoint_layout():
    """The DTensor the reader reads into (and the writer writes from) wraps the host region
    itself: ``DTensor.from_local`` would move it to the mesh's device type, on a GPU all of the
    streamed state at once (at a save too). A CUDA mesh is stood in by its device type."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = layout.mesh_for(dist.group.WORLD, torch.device("cpu"))
    region = torch.zeros(64)
    with mock.patch.object(DeviceMesh, "device_type", new_callable=mock.PropertyMock,
                           return_value="cuda"):
        flat = layout.flat_dtensor(region[:5], 5, mesh)
    local = flat.to_local()
    assert local.device.type == "cpu" and local.data_ptr() == region.data_ptr()
    assert flat.shape == (5,) and flat.placements[0].is_shard(0)
