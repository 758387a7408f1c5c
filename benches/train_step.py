"""Training-step benchmark: one configuration under several engines, side by side.

A thin entry over the harness behind ``zbuf bench`` (``zbuf.train``), so the two can never
disagree. Every option of ``zbuf bench`` applies; the defaults are the benchmark's: engines
zbuf, fsdp2, ddp and zbuf-eager, 10 warm-up + 20 measured steps, AdamW, bf16 compute with fp32
master weights on GPU. Output: the JSON record (``--out``) and a markdown table next to it.

    python benches/train_step.py --preset qwen3-8b --micro-batch 4 --seq-len 4096 --ac \\
        --out benches/results/train_step_qwen3-8b.json
    python benches/train_step.py --preset qwen3-8b --micro-batch 4 --seq-len 4096 --ac \\
        --mem-frac 0.68 --out benches/results/train_step_qwen3-8b_memfrac068.json
"""

import sys

from zbuf.cli import main

DEFAULT_ENGINES = "zbuf,fsdp2,ddp,zbuf-eager"

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--engines" or a.startswith("--engines=") for a in args):
        args = ["--engines", DEFAULT_ENGINES, *args]
    sys.exit(main(["bench", *args]))
