"""The "selective" block frame compiled in a process of its own while step 0 runs, so that the
re-plan's compile of it is served from Inductor's FX-graph cache.

[Note: a level compiled ahead]
The default (``recompute="checkpointed"``) runs step 0 at the user's checkpointing, measures it,
and re-plans: on CUDA, where the step peaks outside the blocks, it offloads blocks at "selective"
([Note: offloaded under the step's own peak] in block_replan.py), whose frame the re-plan's
first call compiles. At qwen3-14b as rank 0 of 8 on an H100 (the user's checkpoint inside each
block) that compile was 5.1 s of a 7.7 s re-plan step: Dynamo 0.3, AOTAutograd 1.5, Inductor's
lowering 1.0 and its kernels 2.3 s, and the time to the final plan 1.62x FSDP2's first step,
where the target is 1.5x (benches/results/onepath14.md).

Every level's frame is a copy of one code object, so Dynamo traces the same graph for each
(``BlockFrames.frame_of``); only the partitioner differs. So the level-0 frame's backend, before
it compiles, sends its Dynamo graph (torch's ``GraphPickler``, with fake tensors for the example
inputs) and the partitioner the re-plan would build for "selective" to a new Python process,
which compiles it (``python -m zbuf.compile.frame_ahead``: the backward with the forward) into
the same Inductor cache directory and exits. When the "selective" frame's backend gets its
graph, it waits for that process, then compiles as before: AOTAutograd traces and partitions
again (its cache key differs between the two compiles: Dynamo's tracing context), and both of
the partition's graphs come out of the FX-graph cache, their lowering and kernels skipped. The
cache decides what is served, by a key over the graph, its inputs and Inductor's settings, so a
graph that differs (another shape, a setting the child did not get) compiles as it would have,
and what runs is what the process would have compiled itself.

Why another process: a compile on a second thread of this one broke in torch 2.11. AOTAutograd's
tracing sets FX's module-global "symbolic tracing" flag, and a compiled frame called meanwhile
raises; with that check off, the frames' guards failed while the thread compiled and Dynamo
compiled them again (onepath14.md).

Only on CUDA with Inductor, for blocks with their own checkpoint: on the CPU stand-in the default
never offloads (its profile sees no activations), aot_eager has no FX-graph cache, and a block
under its caller's checkpoint already runs level 0 through its "selective" frame ([Note: a block
under the caller's checkpoint] in block_frames.py). What the child costs, beside step 0: a
Python process that imports torch and zbuf, a CUDA context on the rank's device (Inductor loads
the kernels it compiles; a few hundred MB while it lives), and Inductor's compile workers of its
own, beside the ones compiling level 0's kernels. Where the plan offloads nothing, that was for
nothing. A child that fails (the record keeps its exit code and last line) or runs past
``WAIT_SECONDS`` leaves the compile to the re-plan, as before; a graph ``GraphPickler`` cannot
carry is not sent (a warning says so). Dynamo's node metadata that it cannot pickle
(``_DROPPED_META``) is dropped from the copy; on the CPU both graphs were still served
(tests/test_block_offload.py). Not yet measured on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Optional

import torch

__all__ = ["CompiledAhead"]

WAIT_SECONDS = 120
"""How long a compile waits for the child before it kills it and compiles the graph itself: the
child compiles what that compile would, so a child still at it after two minutes is stuck."""

_DROPPED_META = ("grapharg", "example_value", "nn_module_stack", "source_fn_stack")
"""Dynamo's node metadata that ``GraphPickler`` cannot pickle (weak references, sources)."""


class CompiledAhead:
    """One Dynamo graph compiled by a child process at another level, into the FX-graph cache
    ([Note: a level compiled ahead])."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, level: int, inner: str,
                 partitioner: Any) -> None:
        """Write the child's input: a copy of ``gm`` (before it is compiled: the compile rewrites
        it), fake ``example_inputs``, and Inductor's and AOTAutograd's settings."""
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx._graph_pickler import GraphPickler, Options

        self.level = level
        """The frame level the child compiles."""
        graph = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        for module in graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    for key in _DROPPED_META:
                        node.meta.pop(key, None)
        fake_mode = detect_fake_mode(example_inputs)
        fakes = [fake_mode.from_tensor(t)
                 if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
                 for t in example_inputs]
        payload = GraphPickler.dumps(
            (graph, fakes, inner, partitioner, torch._inductor.config.save_config(),
             torch._functorch.config.save_config()), Options(ops_filter=None))
        handle, self._path = tempfile.mkstemp(prefix="zbuf-ahead-", suffix=".pkl")
        with os.fdopen(handle, "wb") as f:
            f.write(payload)
        self._process: Optional[subprocess.Popen] = None
        self._began = 0.0
        self.seconds: Optional[float] = None
        """How long the child ran (None before it ended)."""
        self.waited_seconds = 0.0
        """How long the compile that needed it waited for the child."""
        self.returncode: Optional[int] = None
        self._log: Any = None
        self._error = b""
        self.end: Optional[weakref.finalize] = None
        """Stops the child (its compile workers too) and removes its files; called when this
        object goes, or at exit (producer: ``start``)."""

    def start(self) -> None:
        """Start the child, which inherits this process's environment (its Inductor cache
        directory and visible devices)."""
        self._began = time.perf_counter()
        # Its output goes to a file: a pipe nobody reads before the re-plan would stall it.
        self._log = tempfile.TemporaryFile()
        # A session of its own: stopping it stops the compile workers it started.
        self._process = subprocess.Popen([sys.executable, "-m", "zbuf.compile.frame_ahead",
                                          self._path], stdout=self._log, stderr=self._log,
                                         start_new_session=True)
        # A plan that never takes it (nothing offloaded) never waits for it.
        self.end = weakref.finalize(self, _end, self._process, self._path, self._log)

    def wait(self) -> bool:
        """Until the child has ended (killed after ``WAIT_SECONDS``); whether it compiled."""
        process = self._process
        if process is not None and self.returncode is None:
            began = time.perf_counter()
            try:
                self.returncode = process.wait(WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                _stop(process)
                self.returncode = process.returncode
            self.waited_seconds = time.perf_counter() - began
            self.seconds = time.perf_counter() - self._began
            self._log.seek(0)
            self._error = self._log.read()
        return self.returncode == 0

    def report(self) -> dict[str, Any]:
        """For the run record: the level, the child's seconds, the seconds a compile waited for
        it, its exit code and, if it failed, the last line it printed."""
        failed = self.returncode not in (None, 0)
        return {"level": self.level, "seconds": self.seconds,
                "waited_seconds": self.waited_seconds, "returncode": self.returncode,
                "error": (self._error.decode(errors="replace").strip().splitlines() or [""])[-1]
                if failed else None}


def _stop(process: subprocess.Popen) -> None:
    """Kill ``process`` and whatever it started (its session), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _end(process: subprocess.Popen, path: str, log: Any) -> None:
    """Stop ``process`` if it still runs, and remove its input and output."""
    if process.poll() is None:
        _stop(process)
    log.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _compile(path: str) -> None:
    """The child: compile the graph in ``path`` as ``CompiledAhead`` wrote it, at a lower CPU
    priority than the process it works for (its compile workers inherit it)."""
    os.nice(10)
    from .. import ops  # noqa: F401 - zbuf's operators, which the graph may call
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .backend import compile_inner

    with open(path, "rb") as f:
        data = f.read()
    graph, fakes, inner, partitioner, inductor, functorch = GraphPickler.loads(
        data, FakeTensorMode(shape_env=ShapeEnv()))
    torch._inductor.config.load_config(inductor)
    torch._functorch.config.load_config(functorch)
    devices = {t.device for t in fakes if isinstance(t, torch.Tensor)}
    for device in devices:
        if device.type == "cuda":
            torch.cuda.set_device(device)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        compile_inner(graph, fakes, inner, partitioner)


if __name__ == "__main__":
    _compile(sys.argv[1])
