"""``zbuf.shard`` on a model no one here wrote: Hugging Face Qwen3 and Llama from small configs.

Random weights, no download. 2 ranks; each trains 3 AdamW steps and must match the unsharded
single-process reference (loss and every parameter): Qwen3 (tied) eager and under ``aot_eager``,
Llama (untied) eager (one compile keeps the test short on CI).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 3


def _hf_model(kind: str):
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attention_dropout=0.0, attn_implementation="sdpa")
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **common)
        return transformers.Qwen3ForCausalLM(cfg)
    cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    return transformers.LlamaForCausalLM(cfg)


def _hf_worker(rank, world):
    import torch.distributed as dist

    from zbuf.shard import shard
    from zbuf.state_dict import full_state_dict

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 97, (2 * world, 10), generator=g)
    results = {}
    for kind in ("qwen3", "llama"):
        torch.manual_seed(0)
        init = _hf_model(kind)
        ref = copy.deepcopy(init)
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        ref_losses = []
        for _ in range(STEPS):
            loss = ref(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        for mode in ("eager", "aot_eager") if kind == "qwen3" else ("eager",):
            torch._dynamo.reset()
            model = shard(copy.deepcopy(init))
            run = model if mode == "eager" else torch.compile(model, backend="aot_eager")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            mine = tokens.chunk(world)[rank]
            losses = []
            for _ in range(STEPS):
                loss = run(input_ids=mine, labels=mine).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                # labels are shifted inside the model: every row has the same number of targets,
                # so the mean of rank means is the global mean
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{kind} {mode}: {m}")
            full = full_state_dict(model)
            ref_sd = ref.state_dict()
            assert list(full) == list(ref_sd)
            for key, value in ref_sd.items():
                err = (full[key] - value).norm() / value.norm().clamp_min(1e-30)
                assert err <= 1e-5, f"{kind} {mode} {key}: relative error {err:.3g}"
            results[(kind, mode)] = losses
    return results


def test_hugging_face_qwen3_and_llama_match_unsharded():
    results = run_distributed(_hf_worker, 2, timeout=600)
    assert results[0] == results[1]
