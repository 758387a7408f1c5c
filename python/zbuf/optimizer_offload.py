"""The optimizer's state off the device between its uses, for a model that steps in backward.

[Note: optimizer state off the device]
With the optimizer in backward ([Note: optimizer in backward] in optimizer_in_backward.py) the
gradients no longer outlive their batch; what is left of a ZeRO-3 step's state on the device is
the fp32 shards and the optimizer's moments, and the moments are used once per step, for a few
milliseconds per batch. At qwen3-1.7b, world 1, AdamW, they are 12.8 GiB of the 19.2 GiB that
kept zbuf's floor at ``--mem-frac`` 0.20, the same as FSDP2's with fused AdamW
(benches/results/floor17b.md). ZeRO-Offload and DeepCompile's offloading pass keep them in host
memory instead; so does ``StateOffload``, for the state of an optimizer stepped in backward:

* after a batch's step its parameter-shaped state tensors (AdamW's ``exp_avg`` and
  ``exp_avg_sq``; SGD's ``momentum_buffer``) are copied into pinned host tensors (one per state
  tensor, made on the first step, reused after) and the device copies are dropped; scalar state
  (AdamW's ``step``) stays where the optimizer keeps it;
* before a batch's step its state is on the device again: copied while the previous batch's
  backward ran (the batches come in the same order every step; the first step learns it), or,
  for a batch not prefetched, copied then on the compute stream.

Streams and events (two copy streams, since the host link carries both directions at once):
``upload_stream`` is produced on by ``prefetch`` (host to device), which first waits for the
batch's ``stored`` event and for the compute stream; each prefetch records ``ready``, which the
compute stream waits for in ``bring`` before the optimizer reads the tensors.
``download_stream`` is produced on by ``put_back`` (device to host, after it waits for the
compute stream's step), which records the batch's ``stored`` event: what a later upload of the
same host copies (or ``bring``'s own copy of a batch not prefetched) waits for, and what the
compute stream waits for before the device copies are let go. Host tensors are read on the host
only after ``settle`` (``state_dict`` calls it).

[Note: the state's device blocks stay with the compute stream]
Every device copy of the state is allocated from the compute stream's pool, including the ones
``prefetch`` fills on the upload stream (which first waits for the compute stream, so it never
writes a block the compute stream still uses). A downloaded batch's device copies are let go in
the next ``bring``, after the compute stream waits for their ``stored`` event: the blocks go
straight back to the compute stream and the next step's temporaries reuse them. With
``record_stream`` instead, the caching allocator frees a block only once it sees the other
stream's work done, and the host runs ahead of the device: on the H200 at qwen3-1.7b the device
reserved 27.5 GiB for 11.8 GiB allocated, and step 0 ran out of memory at ``--mem-frac`` 0.15
behind a queue of downloads. So the device holds the state of at most two batches: while a batch
steps, its own; after its step, its download and the next batch's upload.

What it costs: two copies of the moments over the host link per step, overlapped with backward
except for the first batch of a step and whatever backward is too short to hide (qwen3-1.7b, one
H200, AdamW: 748 ms a step against 545 ms with the state on the device); the device holds the
state of at most two batches ([Note: the state's device blocks stay with the compute stream]).
On a CPU device the
state is already in host memory: the state stays where it is and nothing is copied.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .host_arena import ALIGN, HostArena, span_bytes
from .memory.optimizer_state import OptimizerPolicy

__all__ = ["StateOffload"]

BatchKey = tuple[int, ...]

class StateOffload:
    """Keeps ``optimizer``'s parameter-shaped state in pinned host memory between the steps in
    backward that use it ([Note: optimizer state off the device])."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.copies = device.type == "cuda"
        self.upload_stream: Optional[torch.cuda.Stream] = (
            torch.cuda.Stream(device) if self.copies else None)
        """Produced on by ``prefetch``; consumed by the compute stream through the ``ready``
        events ``bring`` waits for."""
        self.download_stream: Optional[torch.cuda.Stream] = (
            torch.cuda.Stream(device) if self.copies else None)
        """Produced on by ``put_back``; consumed by later uploads through ``stored`` events, and
        by the host after ``settle``."""
        self._stored: dict[BatchKey, torch.cuda.Event] = {}
        """Each batch's last download into its host copies."""
        self._homes: dict[tuple[int, str], torch.Tensor] = {}
        """Pinned host copy of each offloaded state tensor, by (id of its parameter, key): views
        of the arenas."""
        self._arenas: list[HostArena] = []
        """Where ``_homes`` are carved from ([Note: host arenas] in zbuf/host_arena.py)."""
        self._next: dict[BatchKey, BatchKey] = {}
        """The batch that followed each batch the last time (steps repeat their order)."""
        self._last: Optional[BatchKey] = None
        self._params_of: dict[BatchKey, list[nn.Parameter]] = {}
        """Each batch's parameters (the keys are zbuf's parameter ids, not Python's)."""
        self._prefetched: dict[BatchKey, tuple[torch.cuda.Event, dict]] = {}
        """Batches whose state is on its way: the ``ready`` event and the device tensors."""
        self._leaving: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        """Device copies being downloaded, held until the compute stream has waited for their
        ``stored`` event ([Note: the state's device blocks stay with the compute stream])."""
        self._handles = [
            optimizer.register_state_dict_pre_hook(lambda _opt: self.settle()),
            optimizer.register_load_state_dict_post_hook(lambda _opt: self._put_all_back()),
        ]

    @staticmethod
    def _offloadable(param: nn.Parameter, value) -> bool:
        return isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0

    # -- around one batch's step ------------------------------------------------------------

    def bring(self, key: BatchKey, params: list[nn.Parameter]) -> None:
        """Put the state of ``params`` (batch ``key``) on the device before their step."""
        if self._last is not None:
            self._next[self._last] = key
        self._last = key
        self._params_of[key] = params
        if not self.copies:
            return
        state = self.optimizer.state
        compute = torch.cuda.current_stream(self.device)
        self._let_go(compute)
        pending = self._prefetched.pop(key, None)
        if pending is not None:
            ready, tensors = pending
            compute.wait_event(ready)
            for (p, k), t in tensors.items():
                state[p][k] = t
        stored = self._stored.get(key)
        if stored is not None:  # not prefetched: copied now, after the last download into them
            compute.wait_event(stored)
        for p, k, v in self._on_host(params):
            state[p][k] = v.to(self.device, non_blocking=True)

    def _on_host(self, params: list[nn.Parameter]) -> list[tuple[nn.Parameter, str, torch.Tensor]]:
        """``(parameter, key, host copy)`` of each offloaded state tensor of ``params`` that is
        in host memory now."""
        state = self.optimizer.state
        return [(p, k, v) for p in params for k, v in list(state.get(p, {}).items())
                if self._offloadable(p, v) and v.device != self.device]

    def _let_go(self, compute: torch.cuda.Stream) -> None:
        """Drop the device copies of the batches downloaded so far, once ``compute`` has waited
        for their downloads: their blocks are the compute stream's again."""
        for stored, _tensors in self._leaving:
            compute.wait_event(stored)
        self._leaving.clear()

    def put_back(self, key: BatchKey, params: list[nn.Parameter]) -> None:
        """After the step of ``params`` (batch ``key``): their state to its host copies, the
        device's dropped; then the next batch's state on its way."""
        if not self.copies:
            return
        self._stored[key] = self._download(params)
        following = self._next.get(key)
        if following is not None and following not in self._prefetched:
            self.prefetch(following)

    def _download(self, params: list[nn.Parameter]) -> torch.cuda.Event:
        """Copy the device state of ``params`` into its host copies; the device copies leave
        with the returned ``stored`` event."""
        state = self.optimizer.state
        leaving = []
        self.download_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.download_stream):
            for p in params:
                for k, v in list(state.get(p, {}).items()):
                    if not self._offloadable(p, v) or v.device != self.device:
                        continue
                    home = self._homes.get((id(p), k))
                    if home is None:
                        home = self._homes[(id(p), k)] = self._carve(v)
                    home.copy_(v, non_blocking=True)
                    leaving.append(v)
                    state[p][k] = home
            stored = torch.cuda.Event()
            stored.record(self.download_stream)
        self._leaving.append((stored, leaving))
        return stored

    def prefetch(self, key: BatchKey) -> None:
        """Start copying the state of batch ``key`` to the device on the upload stream."""
        compute = torch.cuda.current_stream(self.device)
        sources = self._on_host(self._params_of[key])
        # Allocated on the compute stream ([Note: the state's device blocks stay with the
        # compute stream]); the upload writes them once the compute stream is past this point.
        tensors = {(p, k): torch.empty_like(v, device=self.device) for p, k, v in sources}
        self.upload_stream.wait_stream(compute)
        stored = self._stored.get(key)
        if stored is not None:
            self.upload_stream.wait_event(stored)
        with torch.cuda.stream(self.upload_stream):
            for p, k, v in sources:
                tensors[(p, k)].copy_(v, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.upload_stream)
        self._prefetched[key] = (ready, tensors)

    def _carve(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped like ``like``, from the arenas ([Note: host arenas] in
        zbuf/host_arena.py): one for all the state, unless it changes shape."""
        home = self._arenas[-1].carve(like) if self._arenas else None
        if home is None:
            self._arenas.append(HostArena(
                max(span_bytes(like), self._arena_bytes()), self.device,
                (self.upload_stream, self.download_stream)))
            home = self._arenas[-1].carve(like)
        return home

    def _arena_bytes(self) -> int:
        """Enough for every parameter's state at once ([Note: optimizer state bytes]), each copy
        aligned: one registration."""
        policy = OptimizerPolicy.of(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return policy.state_bytes(params) + policy.state_copies * len(params) * ALIGN

    # -- the host's view -----------------------------------------------------------------------

    def settle(self) -> None:
        """Wait for every copy: the host copies are complete and safe to read."""
        if self.copies:
            self.upload_stream.synchronize()
            self.download_stream.synchronize()
            self._let_go(torch.cuda.current_stream(self.device))

    def _put_all_back(self) -> None:
        """After ``load_state_dict`` (which puts the state on the parameters' device)."""
        if self.copies:
            compute = torch.cuda.current_stream(self.device)
            for ready, _tensors in self._prefetched.values():  # no longer read: let them land
                compute.wait_event(ready)
            for group in self.optimizer.param_groups:
                self._download(list(group["params"]))
            self.settle()
        self._prefetched.clear()

    def held_bytes(self) -> int:
        """Bytes of device state held by the offload itself now: batches prefetched and not yet
        stepped, downloads not yet let go (at most two batches')."""
        tensors = [t for _ready, ts in self._prefetched.values() for t in ts.values()]
        tensors += [t for _stored, ts in self._leaving for t in ts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def prefetched_after(self, key: BatchKey) -> list[nn.Parameter]:
        """The parameters whose state ``put_back`` brings ahead after batch ``key``'s step: the
        batch that followed it last time."""
        following = self._next.get(key)
        return [] if following is None else list(self._params_of[following])

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
