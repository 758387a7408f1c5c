"""How fast the reduce-scatter's cast of one qwen3-14b block's bf16 gradients to fp32 runs, by way.

A probe, not a benchmark of zbuf: it times the cast ``reduce_scatter_launch`` does today
(``grad.reshape(-1).to(float32)`` per weight) against other ways to make the same fp32 bytes,
each checked bit-exact against it.
"""

import json
import sys

import torch

SHAPES = [(5120, 5120), (1024, 5120), (1024, 5120), (5120, 5120), (17408, 5120), (17408, 5120),
          (5120, 17408), (5120,), (5120,), (128,), (128,)]


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in SHAPES]
    ref = [g.reshape(-1).to(torch.float32) for g in grads]
    nbytes = sum(g.numel() * 6 for g in grads)
    compiled = torch.compile(lambda g: g.reshape(-1).to(torch.float32), dynamic=True)
    compiled_list = torch.compile(lambda gs: [g.reshape(-1).to(torch.float32) for g in gs])
    outs = [torch.empty(g.numel(), device="cuda", dtype=torch.float32) for g in grads]

    ways = {
        "to(float32) per weight (today)": lambda: [g.reshape(-1).to(torch.float32) for g in grads],
        "copy_ into fp32 per weight": lambda: [o.copy_(g.reshape(-1)) for o, g in zip(outs, grads)],
        "_foreach_copy_ into fp32": lambda: torch._foreach_copy_(outs, [g.reshape(-1) for g in grads]),
        "inductor cast per weight (dynamic)": lambda: [compiled(g) for g in grads],
        "inductor cast of the block's list": lambda: compiled_list(grads),
        "mul by 1.0 into fp32 (type promotion)": lambda: [torch.mul(g.reshape(-1), 1.0, out=o) for o, g in zip(outs, grads)],
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bytes_moved": nbytes}
    for name, fn in ways.items():
        try:
            got = fn()
            got = got if got is not None else outs
            exact = all(torch.equal(a, b) for a, b in zip(got, ref))
            ms = timed(fn)
            result[name] = {"ms": round(ms, 4), "GB_per_s": round(nbytes / ms / 1e6, 1),
                            "bit_exact": exact}
        except Exception as e:  # a way torch does not offer here is reported, not fatal
            result[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        print(name, result[name], flush=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        ways["to(float32) per weight (today)"]()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    result["kernels_today"] = [n[:240] for n in names]
    print(json.dumps(result["kernels_today"], indent=1))
    if len(sys.argv) > 1:
        json.dump(result, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
