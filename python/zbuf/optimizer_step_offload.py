"""The optimizer's state in host memory for an optimizer stepped after backward, streamed through
device slots by a schedule that overlaps the link's two directions with each other, with the
step and, in the step's window, with the end of backward and the next forward.

[Note: optimizer state offloaded after backward]
``StateOffload`` (optimizer_offload.py) needs the optimizer in backward, which needs the whole
graph; the user's own loop, ``loss.backward(); opt.step()`` over ``zbuf.compile(model,
optimizer=opt)``'s block frames, never got it. Yet that loop is where the memory goes: at
qwen3-32b as rank 0 of 8 the fp32 shards are 16.4 GB, their gradients 16.4 GB and AdamW's
moments 32.8 GB of an 80 GiB card, and the moments are read once per step, after backward, when
the activations are gone. ``StepOffload`` keeps them in pinned host memory:

* The parameter-shaped state (AdamW's ``exp_avg``/``exp_avg_sq``) of the *streamed* parameters
  lives in one host arena, laid out per bucket (about ``BUCKET_BYTES`` of state, never split
  across parameter groups, each tensor 256-byte aligned) so that a bucket moves in one copy each
  way. The *resident* parameters (the first ones, up to ``resident_bytes`` of state) keep theirs
  on the device and are stepped by the user's own ``opt.step()`` call, as without offload.
  Scalar state (``step``) stays where the optimizer keeps it.
* Two device slots, each the size of the largest bucket, exist only during the step (made by
  its pre-hook, when the activations are gone; let go by its post-hook): forward and backward
  hold none of the streamed state. Bucket ``i`` uses slot ``i % 2``.
* The schedule (``step_schedule``, pure, tested on its own), run by the optimizer's step
  pre-hook: the first two buckets are uploaded; then for each bucket the compute stream waits
  for its upload, the optimizer steps just that bucket (its ``param_groups`` narrowed, as the
  optimizer in backward does), the bucket goes back to the host on the download stream, and the
  upload of the bucket two ahead into the slot just downloaded follows on the upload stream.
  Then the user's ``step()`` itself runs over the resident parameters only (its
  ``param_groups`` narrowed until the post-hook), which waits for the last downloads and lets
  the slots go.
* Streams: the uploads start once the compute stream reaches the step (the slots' blocks were
  its own until then); an upload waits for its slot's last download (``freed``) and for its
  bucket's (``stored``); the compute stream waits for a bucket's upload (``ready``) before stepping it,
  and for the slots' last downloads before their blocks go back to the caching allocator, so the
  blocks never change hands between streams (what made ``record_stream`` unusable for
  ``StateOffload``: [Note: the state's device blocks stay with the compute stream] there).

Why the slots are not kept through the next forward and backward, prefetched under them (as
``StateOffload`` prefetches): that would hide two buckets' copies (about 50 ms a step at 50
GB/s and 512 MiB buckets) with device memory held at the step's peak, where it is scarce. The
same bytes kept as resident state hide more: they are never copied at all ([Note: offloading
when the step does not fit] in zbuf/offload_choice.py sizes that). What the slots may do
instead is reach out of the step to where the peak is not: uploaded late in backward, released
early in the next forward, as many as the measured step had room for there ([Note: the step's
window] in zbuf/offload_window.py; ``window``).

What it costs: both directions of the link carry the streamed state once per step, at the same
time, so without a window the step lasts about ``streamed bytes / link bandwidth`` longer (0.3 s
for qwen3-14b's 14.8 GB at 50 GB/s), less the compute it overlaps; a window hides the copies of
its buckets behind backward and forward. Each step measures what the compute stream
waited: CUDA events around each of its waits (read a step later, without a host sync);
``bytes_moved`` counts what was copied each way.

Loading a checkpoint puts none of the streamed state on the device, and a resume holds no more
state there than the uninterrupted run would: [Note: loading streamed state].

Bit for bit the update is the one the whole ``step()`` makes: torch's optimizers update each
parameter from its own gradient and state, whatever else the call steps. On a CPU device the
"host" copies are still separate tensors and every copy is made (synchronously), so the
mechanics, the bytes and the results are what the CPU tests check; only the streams and the
overlap need a GPU (tests/gpu/test_step_offload_gpu.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from .devices import indexed
from .memory.optimizer_state import OptimizerPolicy
from .memory.progress import Point
from .offload_window import OffloadWindow
from .host_arena import HostArena, aligned
from .stream_waits import TimedWaits

__all__ = ["StepOffload", "streamed_state_of", "Op", "step_schedule", "plan_buckets",
           "BUCKET_BYTES", "SLOTS"]

BUCKET_BYTES = 512 << 20
"""Streamed state per bucket: big enough that a copy runs near the link's speed and the step's
per-call host cost (about a millisecond) stays far below a bucket's copy (about 10 ms at 50 GB/s);
small enough that the step's two slots cost little device memory."""

SLOTS = 2
"""Device slots the streamed buckets pass through: one stepping, one arriving."""

STEPS_KEPT = 64
"""Per-step records kept (bytes moved, exposed time)."""


class Op(NamedTuple):
    """One action of the schedule, in the order it is issued."""

    kind: str
    """"upload" (host to slot), "step" (the optimizer over the bucket) or "download"."""
    bucket: int
    slot: int


def step_schedule(buckets: int, slots: int = SLOTS) -> list[Op]:
    """The order of one step's work over ``buckets`` streamed buckets and ``slots`` device slots
    ([Note: optimizer state offloaded after backward])."""
    ops = [Op("upload", i, i % slots) for i in range(min(slots, buckets))]
    for i in range(buckets):
        ops.append(Op("step", i, i % slots))
        ops.append(Op("download", i, i % slots))
        if i + slots < buckets:
            ops.append(Op("upload", i + slots, i % slots))
    return ops


def plan_buckets(sizes: list[tuple[int, int]], resident_bytes: int,
                 bucket_bytes: int = BUCKET_BYTES) -> tuple[list[int], list[list[int]]]:
    """Split parameters into resident ones and streamed buckets. ``sizes``: ``(group index,
    state bytes)`` of each parameter in order. The first parameters whose state adds up to at
    most ``resident_bytes`` stay; the rest form buckets in order, each closed by the parameter
    that reaches ``bucket_bytes`` or by the end of its group. Returns indices."""
    resident: list[int] = []
    buckets: list[list[int]] = []
    total = 0
    i = 0
    while i < len(sizes) and total + sizes[i][1] <= resident_bytes:
        total += sizes[i][1]
        resident.append(i)
        i += 1
    current: list[int] = []
    filled = 0
    for j in range(i, len(sizes)):
        if current and sizes[j][0] != sizes[current[-1]][0]:
            buckets.append(current)
            current, filled = [], 0
        current.append(j)
        filled += sizes[j][1]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return resident, buckets


def streamed_state_of(optimizer: torch.optim.Optimizer) -> Optional["StepOffload"]:
    """The ``StepOffload`` installed on ``optimizer``, or None: what a checkpoint reader asks
    where the state it reads goes ([Note: loading streamed state])."""
    return optimizer.__dict__.get(_ATTRIBUTE)


_ATTRIBUTE = "_zbuf_step_offload"


def _offloadable(param: torch.Tensor, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


@dataclass
class _Bucket:
    """One streamed bucket: its parameters, their group, and where its state lives."""

    params: list[nn.Parameter]
    group: dict
    capacity: int
    """Bytes of its host region and the most it may use of a slot."""
    host: Optional[torch.Tensor] = None
    """Its region of the host arena (uint8)."""
    entries: dict[tuple[int, str], tuple[int, torch.dtype, torch.Size]] = field(
        default_factory=dict)
    """(id of parameter, key) -> (offset, dtype, shape) in the region and in its slot."""
    used: int = 0
    """Bytes of the region in use (what each copy moves)."""
    stored: Any = None
    """CUDA: the event of its last download."""
    ready: Any = None
    """CUDA: the event of its last upload."""

    def view(self, base: torch.Tensor, key: tuple[int, str]) -> torch.Tensor:
        offset, dtype, shape = self.entries[key]
        nbytes = shape.numel() * dtype.itemsize
        return base[offset:offset + nbytes].view(dtype).view(shape)


class StepRecord(NamedTuple):
    """What one optimizer step moved, and how long the compute stream waited for it."""

    uploaded_bytes: int
    downloaded_bytes: int
    exposed_ms: float
    """CUDA: the time the compute stream stood still waiting for uploads; CPU: the wall time of
    the copies (the host makes them itself: all of it exposed)."""


class StepOffload:
    """Keeps ``optimizer``'s parameter-shaped state of all but ``resident_bytes`` of it in host
    memory between steps after backward ([Note: optimizer state offloaded after backward]).

    ``active=False``: installed but not yet on (the memory owner turns it on with ``activate``
    before the first step creates any state: [Note: offloading when the step does not fit] in
    zbuf/offload_choice.py); until then its hooks only hold loaded state aside until the step
    ([Note: loading streamed state])."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 resident_bytes: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 active: bool = True) -> None:
        self._step_fn = type(optimizer).step
        """The optimizer's own step, called once per bucket inside the user's ``step()`` with
        the optimizer's step hooks set aside, so that they (the step's memory phases, the
        user's) run once per step. Torch's global optimizer hooks run per bucket."""
        self.optimizer = optimizer
        self.device = indexed(device)  # ``_own`` compares it with the shards'
        self.copies_async = self.device.type == "cuda"
        self.bucket_bytes = bucket_bytes
        self.resident_bytes = 0
        """State that stays on the device (planned: the first parameters' up to what
        ``activate`` was given)."""
        self.active = False
        self.buckets: list[_Bucket] = []
        self.streamed: frozenset[int] = frozenset()
        """Ids of the parameters whose state the buckets hold (set by ``activate``)."""
        self._home: dict[int, _Bucket] = {}
        """Id of a streamed parameter -> its bucket."""
        self.slot_bytes = 0
        """Bytes of each slot: the largest bucket's."""
        self.slots: list[Optional[torch.Tensor]] = []
        """The slots, during a step (and its window) only; None: one given back."""
        self._freed: list[Any] = []
        """CUDA: each slot's last download event."""
        self._arena: Optional[HostArena] = None
        """Every bucket's host copies ([Note: host arenas] in zbuf/host_arena.py)."""
        self._groups: Optional[list[dict]] = None
        """The user's ``param_groups`` while the step runs narrowed to all but the streamed
        parameters."""
        self._waits = TimedWaits()
        """CUDA: the compute stream's waits of the last step."""
        self._pending: tuple[int, int, float] = (0, 0, 0.0)
        """What the copies since the last step's record moved: (uploaded, downloaded, CPU copy
        seconds); the window's uploads in backward count toward the step they are for."""
        self.records: list[StepRecord] = []
        self.window: Optional[OffloadWindow] = None
        """Where the streamed buckets are on the device beyond the optimizer step, once the
        memory owner planned it ([Note: the step's window] in zbuf/offload_window.py); None:
        inside the step only."""
        self.window_off: Optional[str] = None
        """Why the window was turned off, if it was."""
        self._draining: list[int] = []
        """The last step's slots still held, in the order their last downloads were issued
        (each goes back at its release point: ``_release``)."""
        self._aside: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        """Loaded parameter-shaped state kept out of the optimizer, as it was given: active, the
        streamed parameters' during ``load_state_dict``; inactive, every parameter's, until the
        next step begins ([Note: loading streamed state])."""
        self.upload_stream = torch.cuda.Stream(self.device) if self.copies_async else None
        self.download_stream = torch.cuda.Stream(self.device) if self.copies_async else None
        self._handles = [
            optimizer.register_step_pre_hook(lambda _o, _a, _k: self._before_step()),
            optimizer.register_step_post_hook(lambda _o, _a, _k: self._after_step()),
            optimizer.register_state_dict_pre_hook(lambda _o: self.settle()),
            optimizer.register_state_dict_post_hook(lambda _o, sd: self._with_aside(sd)),
            optimizer.register_load_state_dict_pre_hook(lambda _o, sd: self._set_aside(sd)),
            optimizer.register_load_state_dict_post_hook(lambda _o: self._loaded()),
        ]
        optimizer.__dict__[_ATTRIBUTE] = self
        if active:
            self.activate(resident_bytes)

    # -- layout -------------------------------------------------------------------------------

    def activate(self, resident_bytes: int) -> None:
        """Turn on, keeping the state of the first ``resident_bytes`` on the device. The layout is
        planned from the shards and the optimizer's type; state the optimizer has already (a
        resumed run's, loaded before step 0 decided) moves into the host regions."""
        if self.active:
            raise RuntimeError("StepOffload.activate: already active")
        policy = OptimizerPolicy.of(self.optimizer)
        self.active = True
        if policy.state_copies == 0:
            return  # no parameter-shaped state (SGD without momentum)
        params, groups, sizes = [], [], []
        seen: set[int] = set()
        for gi, g in enumerate(self.optimizer.param_groups):
            for p in g["params"]:
                if self._own(p) and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
                    groups.append(g)
                    sizes.append((gi, policy.state_bytes([p])))
        resident, buckets = plan_buckets(sizes, resident_bytes, self.bucket_bytes)
        self.resident_bytes = sum(sizes[i][1] for i in resident)
        self.buckets = [
            _Bucket([params[i] for i in b], groups[b[0]],
                    sum(aligned(sizes[i][1] // policy.state_copies) * policy.state_copies
                        for i in b))
            for b in buckets]
        total = sum(b.capacity for b in self.buckets)
        if self.buckets:
            self._arena = HostArena(total, self.device, tuple(
                s for s in (self.upload_stream, self.download_stream) if s is not None))
            start = 0
            for b in self.buckets:
                b.host = self._arena.memory[start:start + b.capacity]
                start += b.capacity
            self.slot_bytes = max(b.capacity for b in self.buckets)
        self._home = {id(p): b for b in self.buckets for p in b.params}
        self.streamed = frozenset(self._home)
        # State loaded before step 0 decided (held aside, or loaded before the offload was
        # installed) goes where the layout puts it now.
        self._take_loaded()

    def _own(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s state is this offload's to place: a parameter on another device (not
        one of the model's shards) keeps its state where the optimizer keeps it."""
        return p.requires_grad and p.device == self.device

    def offloaded_bytes(self) -> int:
        """Bytes of state the host arena holds room for (the streamed parameters')."""
        return sum(b.capacity for b in self.buckets)

    def host_held_bytes(self) -> int:
        """Bytes of state tensors that point at their host copies now (between steps: all the
        streamed state)."""
        if self._arena is None:
            return 0
        lo = self._arena.memory.data_ptr()
        hi = lo + self._arena.nbytes
        return sum(v.numel() * v.element_size()
                   for b in self.buckets for p in b.params
                   for v in self.optimizer.state.get(p, {}).values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0 and lo <= v.data_ptr() < hi)

    def device_bytes(self) -> int:
        """Device bytes the streamed state takes during the step: its slots (none outside)."""
        slots = SLOTS if self.window is None else self.window.slots
        return self.slot_bytes * min(slots, len(self.buckets))

    # -- one step -----------------------------------------------------------------------------

    def _before_step(self) -> None:
        if not self.active:
            # Undecided until now (the memory owner's pre-hook ran first): kept on the device.
            self._take_loaded()
            return
        if self._groups is not None:  # the last step raised before its post-hook
            self.optimizer.param_groups = self._groups
            self._groups = None
        self._release()  # no forward since the last step: its downloads are waited for here
        self._read_waits()
        uploaded = len(self.slots)  # the window's buckets, uploaded in backward
        ring = min(SLOTS if self.window is None else self.window.slots, len(self.buckets))
        while len(self.slots) < ring:
            self._add_slot()
        for op in step_schedule(len(self.buckets), ring):
            if op.kind == "upload":
                if op.bucket >= uploaded:
                    self._upload(op.bucket, op.slot)
            elif op.kind == "step":
                self._step_bucket(op.bucket, op.slot)
            else:
                self._download(op.bucket, op.slot)
        opt = self.optimizer
        self._groups = opt.param_groups
        opt.param_groups = [dict(g, params=[p for p in g["params"] if id(p) not in self.streamed])
                            for g in self._groups]

    def _add_slot(self) -> None:
        """One more slot, made on the compute stream where its own memory is free: in the
        optimizer step, backward's activations are gone; at a window's upload point, what runs
        after it is measured to fit beside it ([Note: the step's window] in
        zbuf/offload_window.py)."""
        self.slots.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
        self._freed.append(None)
        if self.copies_async:
            # Its block was the compute stream's until now: the upload writes it once the
            # compute stream is past this point.
            self.upload_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _after_step(self) -> None:
        if self._groups is None:
            return
        self.optimizer.param_groups = self._groups
        self._groups = None
        n, ring = len(self.buckets), len(self.slots)
        # The slots in the order their last downloads were issued: bucket n - ring + t's.
        self._draining = [(n - ring + t) % ring for t in range(ring)]
        if self.window is None:
            self._release()
        up, down, seconds = self._pending
        self._pending = (0, 0, 0.0)
        self.records.append(StepRecord(up, down, seconds * 1e3))
        del self.records[:-STEPS_KEPT]

    # -- the window ---------------------------------------------------------------------------

    def at(self, point: Point) -> None:
        """A progress point of the step ([Note: progress points] in zbuf/memory/progress.py):
        where the window uploads its buckets and lets its slots go ([Note: the step's window]
        in zbuf/offload_window.py)."""
        window = self.window
        if window is None or not self.active:
            return
        if point.phase == "forward":
            if point.index == 0 and self.slots and not self._draining:
                self._accumulating()
            else:
                self._release(window.releases, point.index)
            return
        self._release()  # the forward was too short to reach the release points
        while (len(self.slots) < min(window.slots, len(self.buckets))
               and window.uploads[len(self.slots)] <= point.index):
            self._add_slot()
            self._upload(len(self.slots) - 1, len(self.slots) - 1)

    def _accumulating(self) -> None:
        """A forward between the window's uploads and the optimizer step: the loop accumulates
        gradients over several backwards, and the uploads made for the step would be held
        through this forward's peak. The window turns off for the run (which backward is the
        last before a step is the loop's to know); the step uploads these buckets again (its
        record counts both uploads)."""
        ahead = self.buckets[:len(self.slots)]
        if self.copies_async:
            compute = torch.cuda.current_stream(self.device)
            for b in ahead:
                if b.ready is not None:
                    self._waits.wait(compute, b.ready)
        for b in ahead:
            b.ready = None
        self.slots, self._freed = [], []
        self.window = None
        self.window_off = ("a forward ran between backward and the optimizer step (gradient "
                           "accumulation): the state is uploaded in the optimizer step")

    def _release(self, points: tuple[int, ...] = (), reached: int = 0) -> None:
        """The last step's slots go back to the caching allocator, on the compute stream, each
        once its last download is done: those whose release point (``points``, in download
        order) ``reached`` has come to, or all of them. The time the compute stream waits is
        its step's exposed time."""
        if not self._draining:
            return
        compute = torch.cuda.current_stream(self.device) if self.copies_async else None
        while self._draining:
            released = len(self.slots) - len(self._draining)
            if released < len(points) and points[released] > reached:
                return
            slot = self._draining.pop(0)
            if compute is not None and self._freed[slot] is not None:
                self._waits.wait(compute, self._freed[slot])
            self.slots[slot] = None
        self.slots, self._freed = [], []

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copies_async:
            dst.copy_(src, non_blocking=True)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            up, down, seconds = self._pending
            self._pending = (up, down, seconds + time.perf_counter() - t0)

    def _count(self, up: int = 0, down: int = 0) -> None:
        u, d, s = self._pending
        self._pending = (u + up, d + down, s)

    def _upload(self, i: int, slot: int) -> None:
        """Bucket ``i``'s host region into ``slot``, after the slot's last download."""
        b = self.buckets[i]
        if b.used == 0:
            return  # nothing stored yet (its first step makes the state)
        if not self.copies_async:
            self._copy(self.slots[slot][:b.used], b.host[:b.used])
            self._count(up=b.used)
            return
        stream = self.upload_stream
        for event in (self._freed[slot], b.stored):
            if event is not None:
                stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._copy(self.slots[slot][:b.used], b.host[:b.used])
            b.ready = torch.cuda.Event()
            b.ready.record(stream)
        self._count(up=b.used)

    def _step_bucket(self, i: int, slot: int) -> None:
        b = self.buckets[i]
        state = self.optimizer.state
        base = self.slots[slot]
        if self.copies_async:
            compute = torch.cuda.current_stream(self.device)
            if b.ready is not None:
                self._waits.wait(compute, b.ready)  # the upload waited for the slot's download
                b.ready = None
            elif self._freed[slot] is not None:
                # Nothing uploaded (its first step): the state it makes is copied into the slot
                # below, after the slot's last download.
                self._waits.wait(compute, self._freed[slot])
        self._point(b, base)
        opt = self.optimizer
        everything = opt.param_groups
        hooks = opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks
        opt.param_groups = [dict(b.group, params=b.params)]
        # Rebound, not cleared: the user's step is iterating over these dicts right now.
        opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = {}, {}
        try:
            self._step_fn(opt)
        finally:
            opt.param_groups = everything
            opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = hooks
        # State the step made (the first step of a parameter): into the slot, laid out for good.
        for p in b.params:
            for k, v in list(state.get(p, {}).items()):
                if _offloadable(p, v) and (id(p), k) not in b.entries:
                    self._place(b, base, p, k, v)

    def _point(self, b: _Bucket, base: torch.Tensor) -> None:
        """Bucket ``b``'s state tensors become views of ``base``: its slot, or its host region."""
        state = self.optimizer.state
        for p in b.params:
            for k in list(state.get(p, {})):
                if (id(p), k) in b.entries:
                    state[p][k] = b.view(base, (id(p), k))

    def _place(self, b: _Bucket, base: torch.Tensor, p: nn.Parameter, k: str,
               v: torch.Tensor) -> None:
        """``v`` into ``base`` (its slot or its host region), laid out on first sight; the state
        points at it there."""
        if (id(p), k) not in b.entries:
            self._lay_out(b, p, k, v)
        home = b.view(base, (id(p), k))
        if not (home.data_ptr() == v.data_ptr() and home.dtype == v.dtype
                and home.device == v.device):  # read there already (``load_home``)
            home.copy_(v)
        self.optimizer.state[p][k] = home

    def _lay_out(self, b: _Bucket, p: nn.Parameter, k: str, v: torch.Tensor) -> None:
        nbytes = v.numel() * v.element_size()
        if b.used + nbytes > b.capacity:
            raise RuntimeError(
                f"zbuf offload_optimizer: {type(self.optimizer).__name__} keeps more "
                f"parameter-shaped state than {OptimizerPolicy.of(self.optimizer).state_copies} "
                f"copies per parameter ([Note: optimizer state bytes] in "
                f"zbuf/memory/optimizer_state.py); add it to optimizer_state.STATE_COPIES or drop "
                f"offload_optimizer")
        b.entries[(id(p), k)] = (b.used, v.dtype, v.shape)
        b.used += aligned(nbytes)

    def _download(self, i: int, slot: int) -> None:
        """Bucket ``i`` from ``slot`` to its host region, after the compute stream's step; the
        state points at the host copies from here on."""
        b = self.buckets[i]
        if b.used:
            if self.copies_async:
                stream = self.download_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._copy(b.host[:b.used], self.slots[slot][:b.used])
                    b.stored = torch.cuda.Event()
                    b.stored.record(stream)
                self._freed[slot] = b.stored
            else:
                self._copy(b.host[:b.used], self.slots[slot][:b.used])
            self._count(down=b.used)
        self._point(b, b.host)

    def _read_waits(self) -> None:
        """Add the last step's measured waits to its record (its events are long done: a whole
        forward and backward ran since)."""
        if not self._waits or not self.records:
            return
        ms = self._waits.read_ms()
        last = self.records[-1]
        self.records[-1] = last._replace(exposed_ms=last.exposed_ms + ms)

    # -- the host's view ----------------------------------------------------------------------

    def settle(self) -> None:
        """Wait for every copy: the host copies are complete and safe to read."""
        if self.copies_async:
            self.upload_stream.synchronize()
            self.download_stream.synchronize()

    def load_home(self, p: torch.Tensor, key: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """[Note: loading streamed state]

        Where a checkpoint reader reads ``p``'s parameter-shaped state ``key`` (saved as
        ``dtype``) before it hands it to ``load_state_dict``: a host tensor of ``p``'s shape,
        every element the reader's to fill, or None for the device.

        ``Optimizer.load_state_dict`` puts every state tensor on its parameter's device before
        any hook sees it, and a reader that reads the state into device tensors has put it there
        before that: all of the streamed state on the device at once (at qwen3-32b as rank 0 of
        8, 32.8 GB of AdamW moments, the state offloaded because it does not fit). So neither
        does here. A reader asks this first (``zbuf.load_checkpoint`` does): a streamed
        parameter's state is read straight into its host region, laid out as its first step
        would lay it out; a resident parameter's goes to the device, as without offload. Then
        ``load_state_dict``'s pre-hook takes the offloaded parameters' state out of the dict
        torch loads (a new dict: the caller's is left as it was), and its post-hook places it
        from wherever it was given into the host regions (nothing to copy for what was read
        there); the device never holds it.

        Undecided (installed inactive: ``offload_optimizer=None``, whose step 0 decides), the
        rule is that a resumed run holds no more state on the device, at any point, than the
        run that was never interrupted: that run makes its state in step 0's optimizer step,
        after the forward and backward the decision measures, and keeps on the device what the
        decision leaves there. So an inactive offload gives host tensors for every parameter's
        state, takes all of it out of what torch loads, and holds it aside in host memory until
        the next step begins; by then the memory owner's step pre-hook (installed before this
        one) has decided: ``activate`` places it (streamed: the host regions; resident: the
        device), or, the state kept, this offload's pre-hook moves all of it to the device.
        The resumed step's forward and backward, and what the decision measures, are the
        uninterrupted run's; the state reaches the device where that run makes it.
        ``state_dict()`` includes what is held aside. State loaded before the offload was
        installed (``load_state_dict`` before ``zbuf.compile(model, optimizer=opt)``) is on the
        device already, and moves when the offload turns on: load after ``zbuf.compile``."""
        if not self._own(p) or p.dim() == 0:
            return None
        if p.is_floating_point() and dtype.is_floating_point:
            dtype = p.dtype  # as load_state_dict casts it
        if not self.active:
            return torch.empty(p.shape, dtype=dtype)
        b = self._home.get(id(p))
        if b is None:
            return None  # resident
        if (id(p), key) not in b.entries:
            self._lay_out(b, p, key, torch.empty(p.shape, dtype=dtype, device="meta"))
        return b.view(b.host, (id(p), key))

    def _set_aside(self, state_dict: dict) -> Optional[dict]:
        """``load_state_dict``'s pre-hook ([Note: loading streamed state]): the offloaded
        parameters' parameter-shaped state (active: the streamed ones'; inactive: all) out of
        the dict torch loads, held aside as given."""
        self._aside = {}  # a load replaces all of the state, what an earlier one held aside too
        if self.active and not self._home:
            return None
        saved = [g["params"] for g in state_dict["param_groups"]]
        groups = [g["params"] for g in self.optimizer.param_groups]
        if [len(g) for g in saved] != [len(g) for g in groups]:
            return None  # load_state_dict refuses it in its own words
        state = dict(state_dict["state"])
        for key, p in zip((i for g in saved for i in g), (p for g in groups for p in g)):
            if key not in state or not self._own(p) or (self.active and id(p) not in self._home):
                continue
            rest = {}
            for k, v in state[key].items():
                if _offloadable(p, v):
                    self._aside.setdefault(p, {})[k] = v
                else:
                    rest[k] = v
            state[key] = rest
        return {**state_dict, "state": state}

    def _loaded(self) -> None:
        """``load_state_dict``'s post-hook: active, the state set aside goes to the host regions;
        inactive, it stays aside until the next step ([Note: loading streamed state])."""
        if self.active:
            self._take_loaded()

    def _take_loaded(self) -> None:
        """The state loaded before it could be placed goes where it lives ([Note: loading
        streamed state]): a streamed parameter's (held aside, or loaded by torch itself before
        the offload turned on) into its host region; the rest held aside onto the device."""
        if not (self.active or self._aside):
            return
        self.settle()
        if not self._draining:  # uploaded in backward: the state before the load
            self.slots, self._freed = [], []
        state = self.optimizer.state
        aside, self._aside = self._aside, {}
        for b in self.buckets:
            b.ready = None
            for p in b.params:
                loaded = {k: v for k, v in state.get(p, {}).items() if _offloadable(p, v)}
                aside[p] = {**loaded, **aside.get(p, {})}
        for p, given in aside.items():
            b = self._home.get(id(p))
            for k, v in given.items():
                if p.is_floating_point() and v.is_floating_point():
                    v = v.to(dtype=p.dtype)  # as load_state_dict casts it
                if b is not None:
                    self._place(b, b.host, p, k, v)
                else:
                    state[p][k] = v.to(device=p.device)

    def _with_aside(self, state_dict: dict) -> Optional[dict]:
        """``state_dict``'s post-hook: the state held aside is the optimizer's too."""
        if not self._aside:
            return None
        index = {id(p): i for i, p in enumerate(
            p for g in self.optimizer.param_groups for p in g["params"])}
        state = state_dict["state"]
        for p, given in self._aside.items():
            i = index[id(p)]
            state[i] = {**state.get(i, {}), **given}  # the optimizer's own dict stays as it is
        return state_dict

    def report(self) -> dict[str, Any]:
        """For the run record: the split, and what the measured steps moved and exposed."""
        self._read_waits()
        recent = self.records[1:]  # the first step makes the state: nothing uploaded
        moved = [r.uploaded_bytes + r.downloaded_bytes for r in recent]
        exposed = sorted(r.exposed_ms for r in recent)
        return {
            "active": self.active,
            "resident_state_bytes": self.resident_bytes if self.active else None,
            "offloaded_state_bytes": self.offloaded_bytes(),
            "device_slot_bytes": self.device_bytes(),
            "buckets": len(self.buckets),
            "window": None if self.window is None else self.window._asdict(),
            "window_off": self.window_off,
            "bytes_moved_per_step": moved[-1] if moved else None,
            "exposed_ms_median": exposed[len(exposed) // 2] if exposed else None,
            "steps": [r._asdict() for r in self.records],
        }

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if streamed_state_of(self.optimizer) is self:
            del self.optimizer.__dict__[_ATTRIBUTE]
