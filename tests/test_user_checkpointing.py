"""The user's activation checkpointing, in every placement a training script puts it, through
every API path, against the unsharded reference ([Note: one path] in compile/compiled_model.py;
[Note: a block under the caller's checkpoint] in compile/block_frames.py).

The model is a user's own decoder: ``nn.Linear`` projections, grouped-query
``F.scaled_dot_product_attention``, RMSNorm, a SiLU MLP, the loss computed outside the model.
Placements: inside the block's ``forward``; around the block call in the parent's loop (the
crash of issue 36); ``apply_activation_checkpointing``; a selective policy (``context_fn``); none;
and a Hugging Face model under its own layer checkpointing (``checkpoint_layers``).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing)
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import zbuf.compile
from zbuf.pool import GatherBufferPool
from zbuf.compile.block_frames import block_frames_of
from zbuf.shard import root_of, shard
from zbuf.train.hf import checkpoint_layers

pytestmark = pytest.mark.usefixtures("one_rank_group", "fresh_dynamo")  # conftest.py

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4, 2, 8, 64, 61
PLACEMENTS = ("inside", "parent", "wrapper", "selective", "none")


def _save_matmuls(ctx, op, *args, **kwargs):
    """torchtitan's op-level selective checkpointing: keep matmul outputs, recompute the rest."""
    return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,)
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _checkpointed(fn, *args, placement: str, preserve_rng_state: bool = True):
    if placement == "selective":
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       _save_matmuls))
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


class Attention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.dropout = dropout

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, placement: str, dropout: float, preserve_rng_state: bool) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(HIDDEN)
        self.attn = Attention(dropout)
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.placement = placement
        self.preserve_rng_state = preserve_rng_state

    def _body(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))

    def forward(self, x, cos, sin):
        if self.placement in ("inside", "selective"):
            return _checkpointed(self._body, x, cos, sin, placement=self.placement,
                                 preserve_rng_state=self.preserve_rng_state)
        return self._body(x, cos, sin)


class Decoder(nn.Module):
    def __init__(self, placement: str, layers: int = 3, dropout: float = 0.0,
                 preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(placement, dropout, preserve_rng_state)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.placement = placement
        self.preserve_rng_state = preserve_rng_state
        if placement == "wrapper":
            apply_activation_checkpointing(self, check_fn=lambda m: isinstance(m, Block))

    def forward(self, tokens):
        t = tokens.shape[1]
        angle = (torch.arange(t, dtype=torch.float32, device=tokens.device)[:, None] / 16
                 + torch.zeros(HEAD_DIM, device=tokens.device))
        cos, sin = angle.cos().to(self.head.weight.dtype), angle.sin().to(self.head.weight.dtype)
        x = self.embed(tokens)
        for block in self.layers:
            if self.placement == "parent":
                x = _checkpointed(block, x, cos, sin, placement="parent",
                                  preserve_rng_state=self.preserve_rng_state)
            else:
                x = block(x, cos, sin)
        return self.head(self.norm(x))


def _loss(model, tokens):
    """The user's fp32 loss, outside the model."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train_steps(model, opt, batches):
    """One step per batch from seed 0 (dropout's draws): the losses."""
    losses = []
    torch.manual_seed(0)
    for tokens in batches:
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _batches(n=3, batch=2, seq=17):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def _compiled(path: str, model: nn.Module, opt: torch.optim.Optimizer, inner: str):
    if path == "zbuf.compile":  # the README's call, no other option but the test's compiler
        return zbuf.compile(model, optimizer=opt, inner=inner)
    if path == "zbuf.compile graph":
        return zbuf.compile(model, optimizer=opt, inner=inner, structure="graph")
    return torch.compile(model, backend="zbuf", options={"inner": inner})


def _against_reference(placement: str, path: str, *, dtype=torch.float32, inner="aot_eager",
                       dropout=0.0, preserve_rng_state=True):
    torch.manual_seed(0)
    init = Decoder(placement, dropout=dropout, preserve_rng_state=preserve_rng_state).to(dtype)
    batches = _batches()
    ref = copy.deepcopy(init)
    ref_losses = train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches)
    model = shard(copy.deepcopy(init), pool=GatherBufferPool())  # its counters this model's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cm = _compiled(path, model, opt, inner)
    return model, train_steps(cm, opt, batches), ref_losses


PATHS = ("zbuf.compile", "zbuf.compile graph", "torch.compile")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_trains_as_the_reference(placement, path):
    model, losses, ref_losses = _against_reference(placement, path)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    if path == "zbuf.compile":  # the default picks one frame per block for this model
        frames = block_frames_of(model)
        assert frames is not None and frames.graphs_compiled >= 1
        # Two blocks live at most, forward and backward, the recompute's included: every gather
        # of the step comes from the pool's budget.
        stats = root_of(model).pool.stats()
        assert stats.outside_allocations == 0 and stats.checked_out == 0, stats


def _hf_qwen3():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=3, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                   max_position_embeddings=64, tie_word_embeddings=False,
                                   attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(cfg)
    checkpoint_layers(model, {"use_reentrant": False})
    return model


class _Logits(nn.Module):
    """The user's call of a Hugging Face model: the logits, the loss outside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens).logits


@pytest.mark.parametrize("path", PATHS)
def test_hugging_face_layers_under_their_own_checkpointing(path):
    torch.manual_seed(0)
    init = _hf_qwen3()
    batches = _batches()
    ref = copy.deepcopy(init)
    ref_losses = train_steps(_Logits(ref), torch.optim.AdamW(ref.parameters(), lr=1e-2), batches)
    model = shard(copy.deepcopy(init), pool=GatherBufferPool())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train_steps(_compiled(path, _Logits(model), opt, "aot_eager"), opt, batches)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    stats = root_of(model).pool.stats()
    assert stats.outside_allocations == 0 and stats.checked_out == 0, stats


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bf16_trains_close_to_the_reference(placement, path):
    _, losses, ref_losses = _against_reference(placement, path, dtype=torch.bfloat16)
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preserve_rng_state", (True, False))
def test_dropout_in_attention_under_the_parents_checkpoint(preserve_rng_state):
    """Dropout draws from the generator: with its state preserved the recompute draws the same
    mask as the forward, and the losses follow the reference's draws."""
    _, losses, ref_losses = _against_reference("parent", "zbuf.compile", dropout=0.1,
                                               preserve_rng_state=preserve_rng_state)
    assert all(torch.isfinite(torch.tensor(losses)))
    if preserve_rng_state:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_the_parents_checkpoint_with_inductor():
    """Issue 36's crash: Inductor compiling the first backward of a model whose parent wraps each
    attention block's call in a checkpoint (at b734542: "Please convert all Tensors to
    FakeTensors first", the generator's state)."""
    _, losses, ref_losses = _against_reference("parent", "zbuf.compile", inner="inductor")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-5)


class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _heap_bytes() -> int:
    """Bytes the C heap holds (glibc: small blocks in arenas, large ones mapped)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _held_after_forward(model, batches) -> list[int]:
    held = []
    for tokens in batches:
        gc.collect()
        before = _heap_bytes()
        loss = _loss(model, tokens)
        gc.collect()
        held.append(_heap_bytes() - before)
        loss.backward()
    return held


def test_the_parents_checkpoint_holds_what_the_users_own_would():
    """Under the parent's checkpoint the block frames save nothing of their own for backward
    (at b734542 their saved-tensor hooks replaced the checkpoint's, keeping every activation of
    every block: qwen3-14b as rank 0 of 8 ran out of memory in step 0's forward)."""
    torch.manual_seed(0)
    init = Decoder("parent", layers=4)
    batches = [torch.randint(0, VOCAB, (8, 129)) for _ in range(3)]
    ref = copy.deepcopy(init)
    ref_held = _held_after_forward(ref, batches)[-1]
    model = shard(copy.deepcopy(init))
    cm = zbuf.compile(model, optimizer=torch.optim.AdamW(model.parameters()), inner="aot_eager")
    held = _held_after_forward(cm, batches)[-1]
    # Every block's activations: 4 blocks x 8 x 128 tokens x ~(8 x 32 + 3 x 64) fp32 values.
    activations = 4 * 8 * 128 * (8 * HIDDEN + 3 * FFN) * 4
    assert held <= ref_held + activations // 4, (held, ref_held, activations)
