"""The four ways to train the same model: ``zbuf``, ``zbuf-eager``, ``fsdp2``, ``ddp``.

Every engine starts from the same materialised fp32 model (same seed, same device), so the
first-step losses agree and per-step losses are comparable; each then applies its own sharding,
mixed precision and compilation. Mixed precision is always "bf16 compute, fp32 master":

- ``ddp``: fp32 parameters under ``torch.autocast(bf16)``; gradients all-reduced in fp32.
- ``fsdp2``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
- ``zbuf`` / ``zbuf-eager``: ``zbuf.shard(param_dtype=bf16, reduce_dtype=fp32)``.

[Note: what each engine compiles]
``ddp`` and ``zbuf`` compile the whole model together with the loss as one graph (the loss
is computed in fp32 without fp32 logits, [Note: lean cross-entropy] in models.py, so it adds no
[B, T, vocab] fp32 activations to the compiled graph). ``fsdp2`` follows torchtitan: every block is
compiled on its own (``Module.compile``, before ``fully_shard`` so FSDP's hooks stay eager) and
the loss function is compiled separately. ``zbuf-eager`` compiles nothing. ``zbuf`` with
``--compile-structure blocks`` compiles as FSDP2 does, one frame per block shared by identical
blocks, the rest eager ([Note: one Dynamo frame per block] in zbuf/compile/block_frames.py).
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import models
from .. import shard as zshard
from ..compile import compiled_model as zcompiled
from ..compile.block_frames import block_frames_of
from ..compile import schedule_report as zschedule_report
from ..pool import GatherBufferPool
from ..memory import StepMemory, pool_budget
from .config import ConfigError, Engine, TrainConfig
from .data import IGNORE_INDEX, Batch
from .hf import check_hf_model, checkpoint_layers

__all__ = ["EngineSetup", "build_engine", "build_base_model", "build_optimizer", "init_module"]


class EngineSetup(NamedTuple):
    step_loss: Callable[[Batch], torch.Tensor]
    """Forward + loss for one batch (compiled where the engine compiles); returns a scalar."""
    model: nn.Module
    """The trained module (sharded / wrapped in place)."""
    optimizer: torch.optim.Optimizer
    pool: Optional[object]
    """The zbuf gather-buffer pool feeding this model (zbuf engines), else None."""
    schedule_report: Callable[[], Optional[dict]]
    """The zbuf schedule (JSON-able) once compiled, else None."""
    step_memory: Optional[object] = None
    """The zbuf engines' ``zbuf.memory.StepMemory`` (whole-step budget, the pool lending
    its idle blocks to the optimizer step, per-phase telemetry), else None."""


class HFDecoder(nn.Module):
    """A ``transformers`` causal LM behind the ``Decoder`` interface: tokens -> logits,
    ``.layers`` the transformer blocks."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.layers = hf_model.model.layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def _hf_model(model_type: str, cfg: models.ModelConfig, device) -> nn.Module:
    check_hf_model(model_type)  # a supported type (laid out like Llama), transformers installed
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_seq_len,
        attention_dropout=0.0)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return HFDecoder(transformers.AutoModelForCausalLM.from_config(hf_cfg))


def build_base_model(cfg: TrainConfig, device: torch.device, *,
                     materialise: bool = True) -> nn.Module:
    """The fp32 model every engine starts from, initialised from ``cfg.seed`` on ``device``;
    ``materialise=False``: left on the meta device, for the engine to materialise shard by shard
    ([Note: simulated ranks] in simulate.py; ``init_module`` initialises each piece)."""
    mcfg = cfg.model_config()
    torch.manual_seed(cfg.seed)
    # "auto" checkpoints every block too: they are the candidate regions the zbuf compiler
    # chooses from ([Note: recompute modes] in compile/recompute.py).
    block_ac = {"off": False, "full": "full", "auto": "full", "selective": "selective"}[cfg.ac]
    if cfg.hf_model:
        model = _hf_model(cfg.hf_model, mcfg, device if materialise else "meta")
        if block_ac:
            kwargs = {"use_reentrant": False}
            if block_ac == "selective":
                kwargs["context_fn"] = models.selective_checkpoint_context
            checkpoint_layers(model.hf, kwargs)
        return model
    model = models.build_model(mcfg, device="meta")
    if materialise:
        model.to_empty(device=device)
        model.reset_parameters()
    models.apply_activation_checkpointing(model, block_ac)
    return model


def init_module(sub: nn.Module, root: nn.Module) -> None:
    """Initialise the freshly materialised parameters and buffers of one submodule of ``root``
    (a model built with ``materialise=False``): the built-in decoder's own ``reset_parameters``;
    a Hugging Face model's ``_init_weights`` (norms, linears, embeddings, rotary tables). The
    root decoder's ``reset_parameters`` would re-initialise every module: skipped."""
    if isinstance(root, HFDecoder):
        if sub is not root:
            root.hf._init_weights(sub)
    elif sub is not root and callable(getattr(sub, "reset_parameters", None)):
        sub.reset_parameters()


def _model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The step's loss, every engine alike: the built-in decoder's own, which never holds the
    logits ([Note: the logits are never whole] in zbuf/linear_cross_entropy.py); a Hugging Face
    model's from its logits."""
    if isinstance(model, HFDecoder):  # fp32 loss without fp32 logits ([Note: lean cross-entropy])
        return models.cross_entropy(model(tokens), targets, ignore_index=IGNORE_INDEX)
    return model(tokens, targets, IGNORE_INDEX)


class _WithLoss(nn.Module):
    """model + loss as one module, so a whole-model compile captures the loss too."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _model_loss(self.model, tokens, targets)


def _compute_dtype(cfg: TrainConfig) -> Optional[torch.dtype]:
    return torch.bfloat16 if cfg.dtype == "bf16" else None


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters (shards for the zbuf engines, DTensors for
    FSDP2, full tensors for DDP): ``adamw`` is torch's default AdamW (foreach on GPU, the
    single-tensor loop on CPU), ``adamw-fused`` AdamW with ``fused=True`` (CUDA and, since torch
    2.4, CPU), ``sgd`` SGD with momentum 0.9."""
    # weight_decay 0: the synthetic tasks need no regularisation and it keeps engines identical.
    params = model.parameters()
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    if cfg.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=0.0)
    raise ConfigError(f"unknown --optimizer {cfg.optimizer!r}")


def build_engine(engine: Engine, cfg: TrainConfig, device: torch.device,
                 group: Optional[dist.ProcessGroup] = None) -> EngineSetup:
    """Build the base model and apply ``engine`` to it. Collective: call on every rank.

    Simulated ranks: the sharded engines get the model on the meta device and materialise only
    this rank's shards ([Note: simulated ranks] in simulate.py); DDP holds the whole model, as a
    real DDP rank does."""
    on_meta = cfg.simulated and engine is not Engine.DDP
    model = build_base_model(cfg, device, materialise=not on_meta)
    dtype = _compute_dtype(cfg)
    builder = {Engine.DDP: _ddp, Engine.FSDP2: _fsdp2, Engine.ZBUF_EAGER: _zbuf_eager,
               Engine.ZBUF: _zbuf}[engine]
    return builder(model, cfg, device, dtype, group)


def _ddp(model, cfg, device, dtype, group) -> EngineSetup:
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(_WithLoss(model), device_ids=[device.index] if device.type == "cuda" else None,
                  process_group=group)
    if cfg.simulated:
        wrapped.register_comm_hook(group or dist.group.WORLD, _simulated_allreduce_hook)
    compiled = torch.compile(wrapped, backend=cfg.compiler)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())

    def step_loss(batch: Batch) -> torch.Tensor:
        with autocast:
            return compiled(batch.tokens, batch.targets)

    return EngineSetup(step_loss, model, build_optimizer(model, cfg), None, lambda: None)


def _simulated_allreduce_hook(group: dist.ProcessGroup, bucket):  # DDP checks a real annotation
    """DDP's default all-reduce, for the fake group: its future holds no value, which DDP's own
    hook passes on and its reducer then rejects; this one hands back the bucket it reduced in
    place, after the same division ([Note: simulated ranks] in simulate.py)."""
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda _done: buffer)


def _fsdp2(model, cfg, device, dtype, group) -> EngineSetup:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    group = group or dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for block in model.layers:
        block.compile(backend=cfg.compiler, fullgraph=not cfg.hf_model)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if any(p.is_meta for p in model.parameters()):  # this rank's shards only, then initialised
        model.to_empty(device=device)
        with torch.no_grad():
            for sub in model.modules():
                init_module(sub, model)
    # The root's head and loss run eager, as torchtitan runs them: the fused loss is one opaque
    # operator each way, nothing a compile would fuse.
    def step_loss(batch: Batch) -> torch.Tensor:
        return _model_loss(model, batch.tokens, batch.targets)

    return EngineSetup(step_loss, model, build_optimizer(model, cfg), None, lambda: None)


def _zbuf_shard(model, device, dtype, group, *, budget_bytes: Optional[int] = None):
    # A pool of its own per engine: what one engine's plans and step memory did to a pool (its
    # budget, its blocks) must not carry over to the next engine of a bench.
    pool = GatherBufferPool(device)
    # A meta model (simulated ranks) is materialised one submodule's shards at a time.
    zshard.shard(model, group, param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                 pool=pool, device=device, init_fn=lambda sub: init_module(sub, model))
    if budget_bytes is not None:
        # Uncompiled, there is no schedule to size the pool: --pool-budget caps it instead.
        pool_budget.set_to(pool, budget_bytes)
    return pool


def _zbuf_eager(model, cfg, device, dtype, group) -> EngineSetup:
    pool = _zbuf_shard(model, device, dtype, group, budget_bytes=cfg.pool_budget)
    optimizer = build_optimizer(model, cfg)
    # No plan to remake; measured, and the pool lends its idle blocks to the optimizer step.
    step_memory = StepMemory(model, optimizer)

    def step_loss(batch: Batch) -> torch.Tensor:
        return _model_loss(model, batch.tokens, batch.targets)

    return EngineSetup(step_loss, model, optimizer, pool, lambda: None, step_memory)


def _zbuf(model, cfg, device, dtype, group) -> EngineSetup:
    pool = _zbuf_shard(model, device, dtype, group)  # its plan sizes the pool
    whole = _WithLoss(model)
    optimizer = build_optimizer(model, cfg)
    # compile_model, not torch.compile(backend="zbuf"): without --gather-budget it agrees the
    # rank-minimum free memory over the sharding group, so every rank plans the same schedule;
    # with the optimizer it puts the whole step under one measured budget.
    card = _stand_in_card(model, cfg, device)
    compiled = zcompiled.compile_model(whole, budget_bytes=cfg.gather_budget,
                                      fullgraph=not cfg.hf_model, inner=cfg.compiler,
                                      optimizer=optimizer,
                                      optimizer_in_backward=cfg.optimizer_in_backward,
                                      # Left out, the plan decides ([Note: offloading
                                      # when the step does not fit] in offload_choice.py).
                                      offload_optimizer=cfg.offload_optimizer or None,
                                      recompute="auto" if cfg.ac == "auto" else "checkpointed",
                                      structure=cfg.compile_structure, **card)

    def step_loss(batch: Batch) -> torch.Tensor:
        return compiled(batch.tokens, batch.targets)

    def schedule_report() -> Optional[dict]:
        frames = block_frames_of(whole)
        if frames is not None:  # no graph holds the step: the frames' runtime schedule does
            replanner = getattr(zcompiled.step_memory_of(compiled), "replanner", None)
            replaced = getattr(replanner, "replaced", [])
            return {"graphs": [], "blocks": dict(frames.schedule(), recompute_replaced=[
                r.to_dict() for r in replaced])}
        records = zschedule_report(model) or zschedule_report(whole) or zschedule_report(None)
        if not records:
            return None
        graphs = to_jsonable(records)
        # Each graph's plan (0: the measured step's; the last: the plan in force), so a record
        # reports the plan that ran last apart from those a re-plan replaced.
        replanner = getattr(zcompiled.step_memory_of(compiled), "replanner", None)
        starts = getattr(replanner, "plan_starts", [0])
        for g in graphs:
            g["plan"] = bisect.bisect_right(starts, g["graph_id"]) - 1
        return {"graphs": graphs}

    return EngineSetup(step_loss, model, optimizer, pool, schedule_report,
                       zcompiled.step_memory_of(compiled))


def _stand_in_card(model: nn.Module, cfg: TrainConfig, device: torch.device) -> dict:
    """``--gpu-memory`` on CPU: the free memory zbuf's CPU stand-in plans against is the card
    less the shards, with the gradients' bytes for the backward graphs (on CUDA the card is
    emulated for real, through ``mem_frac``)."""
    if cfg.gpu_memory is None or device.type != "cpu" or cfg.gather_budget is not None:
        return {}
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # The gradients go to the backward graphs ([Note: gradients live in backward]).
    return {"free_memory_bytes": max(0, cfg.gpu_memory - shards), "gradient_bytes": grads}


def to_jsonable(obj):
    """Dataclasses, named tuples, enums, numpy arrays and tensors -> plain JSON values."""
    import dataclasses
    import enum

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "_asdict"):
        return {k: to_jsonable(v) for k, v in obj._asdict().items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    return str(obj)
