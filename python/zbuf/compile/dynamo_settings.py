"""The Dynamo settings zbuf traces its own compiled callables under.

[Note: forward side effects under checkpoint]
Hugging Face transformers 5.25 and later wrap each attention ``forward`` in the ``kernels``
package's kernel routing: the wrapper sets a module-level ``CompileableContextVar`` before the
body and resets it in a ``finally``, and while Dynamo traces, that is an attribute store on an
object from outside the traced function. Inside a higher-order operator Dynamo refuses any such
store unless the operator is a checkpoint and ``skip_fwd_side_effects_in_bwd_under_checkpoint``
is on, because eager checkpointing would replay it when the backward recomputes the forward. So
a Hugging Face layer under its own gradient checkpointing
- in a nested compile region fails to compile;
- in a block frame graph-breaks at the checkpoint, and the block runs eager, compiling nothing;
- in a whole-graph compile graph-breaks at every layer's checkpoint.

With the flag on, the store happens once, in the forward, and the backward's recompute does not
replay it: for a set-and-reset pair that is the same state afterwards. Only Python state written
by a checkpointed forward is affected (a counter the forward increments would count once per
step, not twice as in eager); tensors and gradients are not. zbuf turns the flag on while Dynamo
traces the callables zbuf itself compiles (``zbuf.compile``'s model, its re-planned model, the
block frames), never process-wide: a plain ``torch.compile(model, backend="zbuf")`` traces under
the caller's settings, and a caller who wants the same sets the flag around the call.

[Note: a refusal surfaces as itself]
Dynamo wraps whatever a backend raises in ``BackendCompilerFailed``, so a plan that cannot fit
reached a ``zbuf.compile`` caller as a Dynamo error whose last line says to set
``TORCHDYNAMO_VERBOSE=1`` (and ``zbuf train`` showed 83 lines of traceback ending there): the
refusal, its numbers and its fix were buried in the middle. The callables zbuf compiles itself
re-raise a ``PlanExceedsMemoryError`` as itself, so ``except PlanExceedsMemoryError`` works and
the message is the last line. A plain ``torch.compile(model, backend="zbuf")`` is Dynamo's to
report: there the refusal is the ``BackendCompilerFailed``'s ``inner_exception``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch._dynamo
from torch._dynamo.exc import BackendCompilerFailed

from .budget import PlanExceedsMemoryError

__all__ = ["traced_as_zbuf"]

_F = TypeVar("_F", bound=Callable[..., Any])


def traced_as_zbuf(compiled: _F) -> _F:
    """``compiled`` (a callable ``torch.compile`` returned), entered under the Dynamo settings of
    [Note: forward side effects under checkpoint] for the length of each call; the caller's
    setting is back after it, also when calls nest (a block frame's recompute in backward). A
    plan refused while compiling is raised as itself ([Note: a refusal surfaces as itself])."""
    config = torch._dynamo.config

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        prior = config.skip_fwd_side_effects_in_bwd_under_checkpoint
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            if isinstance(e.inner_exception, PlanExceedsMemoryError):
                raise e.inner_exception from None
            raise
        finally:
            config.skip_fwd_side_effects_in_bwd_under_checkpoint = prior

    return call  # type: ignore[return-value]
