"""When a training loop saves and resumes: the logic behind ``zbuf train --checkpoint-dir D
--save-every N --resume``, kept here so that a loop needs two calls.

::

    policy = SaveResumePolicy(directory=D, save_every=N, resume=True, run=definition,
                              total_steps=T)
    run = policy.begin(model, optimizer)                # loads the checkpoint to resume, if any
    for step in range(run.start_step, T):
        train_one_step(step)
        run.after_step(step + 1, model, optimizer)      # saves at multiples of N and at T

[Note: checkpoint step numbering]
A checkpoint's ``step`` is the number of optimizer steps completed, which is also the index of the
next step to run. zbuf's training data is a pure function of the step index
(``zbuf.train.data``), so ``range(resume_step, total)`` replays exactly what the uninterrupted run
would have done, and the resumed run's parameters and optimizer state are bit-identical to it
(``tests/test_checkpoint.py``).

[Note: checkpoints belong to one run]
A run is one training trajectory: a fresh start and every restart that resumes it. Its
checkpoints record the run's id and the settings that define it (``run``: model, data, batch,
dtype, learning rate, seed; ``TrainConfig.run_definition``), in the manifest
(``save_checkpoint(..., run=...)``), and:

- a fresh start (no ``--resume``) refuses a directory that already holds checkpoints: they belong
  to another run, whose newest would otherwise outrank the new run's (on ``--resume``, and in
  retention by step number);
- ``--resume`` refuses a checkpoint whose run differs from this one's settings, naming the
  differences; ``--allow-change FIELD,...`` accepts named differences on purpose (a new learning
  rate); the resumed run keeps the checkpoint's run id, and records its new settings from then on;
- retention (``keep_last``) counts and deletes only checkpoints carrying this run's id: a
  checkpoint this run did not write is never deleted;
- a run with ``save_every`` also saves at its final step, so a finished run can be continued;
- ``--resume`` refuses a damaged newest checkpoint (a ``step_N`` directory without its manifest,
  or with a file missing or cut short), naming it, what is wrong and the run's previous one: it
  never falls back to an older one unasked, which would drop the steps after it in silence;
- ``--resume-from step_N`` resumes from an older checkpoint of the run (the way back when the
  newest is damaged); the run's checkpoints after it, and damaged step directories after it,
  move to ``<dir>/superseded/``, so that a later ``--resume`` continues this timeline instead of
  the abandoned one, and no save of this run replaces them; another run's checkpoint after it
  is refused before anything is loaded or moved (this run would meet it at its step, and it
  would outrank this run's checkpoints on a later ``--resume``);
- a run never replaces a checkpoint: every step directory it saves is new. One that is there
  when it saves appeared while it trained, written by another process in the same directory (a
  second copy of the run resumed from the same checkpoint, as a requeued job whose first attempt
  still runs): the run stops there with one line, before writing, and both keep what they had.
  Keeping both checkpoints instead does not fit the directory's design: a checkpoint is named
  by its step alone, and the newest step is what ``--resume`` continues ([Note: atomic
  checkpoint commit] in zbuf/checkpoint/files.py replaces a name only for the run that wrote
  it, and a copy of a run shares its id).

``resume_point`` decides which checkpoint a run continues by reading files only, so the launcher
checks the options before any worker starts (``zbuf.train.runner``) and rank 0 of the workers
decides again (``begin``) under torchrun, where there is no launcher.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from ..checkpoint import files, layout

__all__ = ["SaveResumePolicy", "CheckpointRun", "resume_point", "way_back", "SUPERSEDED_DIR"]

SUPERSEDED_DIR = "superseded"
"""Subdirectory of the checkpoint root where ``--resume-from`` moves the run's later checkpoints."""

_RUN_FORMAT = "zbuf.train/1"


@dataclass(frozen=True)
class SaveResumePolicy:
    """Where and how often a training loop checkpoints. Validated on construction."""

    directory: Optional[str] = None
    """Root of the ``step_<N>`` checkpoints; None: no checkpoints (the other fields must be unset)."""
    save_every: Optional[int] = None
    """Save after every this many completed steps, and at ``total_steps``; None: never save
    (resume only)."""
    resume: bool = False
    """Continue from the latest complete checkpoint under ``directory`` if there is one (a fresh
    start otherwise, so the same command line serves the first run and every restart)."""
    keep_last: int = 2
    """This run's complete checkpoints kept; its older ones are deleted after each save (two, so
    that a checkpoint that turns out damaged still has a predecessor). Other runs' checkpoints
    are never deleted."""
    resume_from: Optional[str] = None
    """Resume from this checkpoint under ``directory`` instead of the latest: its name
    (``step_00000005``) or its step (``5``). Needs ``resume``."""
    run: Optional[dict] = None
    """What defines this run (``TrainConfig.run_definition()``: flag name -> value), recorded in
    every checkpoint and compared on resume ([Note: checkpoints belong to one run])."""
    allow_change: tuple[str, ...] = ()
    """Keys of ``run`` in which a resumed checkpoint may differ from this run (deliberate
    changes, such as a new learning rate)."""
    total_steps: Optional[int] = None
    """The run's last step: with ``save_every``, a checkpoint is saved there too."""

    def __post_init__(self) -> None:
        if self.directory is None:
            if self.save_every is not None or self.resume or self.resume_from is not None:
                raise ValueError("--save-every, --resume and --resume-from need --checkpoint-dir "
                                 "DIR: where checkpoints go")
        elif not isinstance(self.directory, (str, Path)) or not str(self.directory):
            raise ValueError(f"checkpoint directory must be a path, got {self.directory!r}")
        if self.save_every is not None and (
            isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 1
        ):
            raise ValueError(f"save_every must be a positive int (steps), got {self.save_every!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"resume must be a bool, got {self.resume!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {self.keep_last!r}")
        if self.resume_from is not None:
            if not self.resume:
                raise ValueError("resume_from needs resume=True")
            _step_of_name(self.resume_from)  # raises on a name that cannot be a checkpoint
        unknown = sorted(set(self.allow_change) - set(self.run or {}))
        if self.allow_change and self.run is not None and unknown:
            raise ValueError(f"--allow-change {','.join(unknown)}: not a setting that defines a "
                             f"run; choose from {', '.join(self.run)}")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def begin(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> "CheckpointRun":
        """Load the checkpoint this run continues (``resume_point``), or start a new run.

        Collective over the model's sharding group: rank 0 decides (and sets aside checkpoints
        that ``resume_from`` supersedes), every rank follows. Raises ``CheckpointMismatchError``
        on every rank when the options cannot work ([Note: checkpoints belong to one run]).
        """
        if not self.enabled:
            return CheckpointRun(self, run_id=None, start_step=0, resumed_from=None)
        group = _group_of(model)
        decision: dict[str, Any] = {}
        if dist.get_rank(group) == 0:
            try:
                info = resume_point(self)
                if info is None:
                    decision = {"path": None, "run_id": uuid.uuid4().hex}
                else:
                    decision = {"path": str(info.path), "run_id": info.run["id"]}
                    _set_aside_later(self, info)
            except ckpt.CheckpointError as e:
                decision = {"error": str(e), "type": type(e).__name__,
                            "problem": getattr(e, "problem", None),
                            "way_back": getattr(e, "way_back", None)}
            except OSError as e:  # setting checkpoints aside failed: every rank must hear it
                decision = {"error": f"--resume-from: moving later checkpoints aside failed: {e}",
                            "type": "CheckpointError"}
        box = [decision]
        dist.broadcast_object_list(box, group_src=0, group=group)
        decision = box[0]
        if "error" in decision:
            if decision["type"] == "CheckpointCorruptError":
                raise ckpt.CheckpointCorruptError(decision["error"], problem=decision["problem"],
                                                  way_back=decision["way_back"])
            raise getattr(ckpt, decision["type"], ckpt.CheckpointError)(decision["error"])
        if decision["path"] is None:
            return CheckpointRun(self, run_id=decision["run_id"], start_step=0, resumed_from=None)
        try:
            loaded = ckpt.load_checkpoint(decision["path"], model, optimizer)
        except ckpt.CheckpointCorruptError as e:
            raise _damaged(self, Path(decision["path"]), e.problem) from None
        return CheckpointRun(self, run_id=decision["run_id"], start_step=loaded.step,
                             resumed_from=loaded.path)


@dataclass
class CheckpointRun:
    """One process's part of a run under a ``SaveResumePolicy`` (``SaveResumePolicy.begin``)."""

    policy: SaveResumePolicy
    run_id: Optional[str]
    """This run's id: new at a fresh start, the checkpoint's when resumed; None: no checkpoints."""
    start_step: int
    """The step to continue from (0: a fresh start)."""
    resumed_from: Optional[Path]
    """The checkpoint that was loaded, or None."""
    saved: list[Path] = field(default_factory=list)
    """Checkpoints this process saved, oldest first (some may have been pruned since)."""

    def after_step(self, steps_done: int, model: nn.Module,
                   optimizer: Optional[torch.optim.Optimizer]) -> Optional[Path]:
        """Save if ``steps_done`` is a multiple of ``save_every`` or the final step; returns the
        checkpoint path. Then rank 0 prunes this run's older checkpoints.

        Collective over the model's sharding group when it saves (every rank calls it every step).
        """
        p = self.policy
        if not p.enabled or p.save_every is None:
            return None
        if steps_done % p.save_every and steps_done != p.total_steps:
            return None
        run = {"format": _RUN_FORMAT, "id": self.run_id, "definition": p.run}
        path = ckpt.checkpoint_path(p.directory, steps_done)
        _refuse_to_replace(model, path, steps_done)
        path = ckpt.save_checkpoint(path, model, optimizer, step=steps_done, run=run)
        self.saved.append(path)
        if dist.get_rank(_group_of(model)) == 0:
            ckpt.prune(p.directory, keep_last=p.keep_last, only=lambda c: _run_id(c) == self.run_id)
        return path


def resume_point(policy: SaveResumePolicy) -> Optional[ckpt.CheckpointInfo]:
    """The checkpoint a run under ``policy`` continues, or None for a fresh start. Reads files
    only (no process group). Raises ``CheckpointMismatchError`` when the options cannot work
    (another run's checkpoints, different settings, no such checkpoint) and the checkpoint's own
    errors when its manifest cannot be read."""
    if not policy.enabled:
        return None
    root = policy.directory
    found = ckpt.list_checkpoints(root)
    damaged = files.damaged_checkpoints(root)
    if not policy.resume:
        if found or damaged:
            held = sorted([*found, *((s, p) for s, p, _ in damaged)])
            raise ckpt.CheckpointMismatchError(
                f"--checkpoint-dir {root} already holds checkpoints "
                f"({_names([p for _, p in held])}): a new run there would mix its checkpoints "
                f"with theirs. Pass --resume to continue the run they belong to, or give an "
                f"empty --checkpoint-dir for a new run")
        return None
    if policy.resume_from is not None:
        want = _step_of_name(policy.resume_from)
        path = next((p for s, p in found if s == want), None)
        if path is None:
            have = _names([p for _, p in found]) if found else "none"
            raise ckpt.CheckpointMismatchError(
                f"--resume-from {policy.resume_from}: no complete checkpoint step_{want:08d} in "
                f"{root} (complete ones: {have})")
    elif damaged and (not found or damaged[-1][0] > found[-1][0]):
        # The newest is damaged: resuming an older one unasked would silently drop the steps
        # after it, and its next save would replace the damaged directory.
        _, path, problem = damaged[-1]
        raise _damaged(policy, path, problem)
    elif found:
        path = found[-1][1]
    else:
        return None
    try:
        info = ckpt.read_checkpoint_info(path)
        # Every file there, whole: one stat each, before any worker starts (the workers check
        # the CRCs when they load it, [Note: checkpoint integrity] in zbuf/checkpoint/files.py).
        problems = files.check_files(info.path, files.read_manifest(info.path)["files"], 0, 1,
                                     checksums=False)
    except ckpt.CheckpointCorruptError as e:
        raise _damaged(policy, path, e.problem) from None
    if problems:
        raise _damaged(policy, path, "; ".join(problems))
    _check_same_run(policy, info)
    _check_nothing_later(policy, info, found)
    return info


def _refuse_to_replace(model: nn.Module, path: Path, step: int) -> None:
    """Collective: ``CheckpointMismatchError`` on every rank when ``path`` already holds a step
    directory ([Note: checkpoints belong to one run]: a run never replaces a checkpoint)."""
    group = _group_of(model)
    box = [_held_at(path) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group_src=0, group=group)
    if box[0] is not None:
        raise ckpt.CheckpointMismatchError(
            f"--checkpoint-dir {path.parent}: {path.name} appeared there while this run trained "
            f"({box[0]}): another process writes checkpoints in this directory, such as a second "
            f"copy of this run resumed from the same checkpoint. Stopped at step {step} without "
            f"saving; nothing there was changed. Stop the other process, or give this run "
            f"another --checkpoint-dir")


def _held_at(path: Path) -> Optional[str]:
    """What a step directory at ``path`` holds, in words; None when there is none (a replace
    cut short leaves it at ``.<name>.old``: [Note: atomic checkpoint commit])."""
    standing = files.standing_checkpoint(path)
    if standing is not None:
        theirs = _run_id(standing)
        return f"a checkpoint of run {theirs}" if theirs else "a checkpoint of no zbuf train run"
    if path.is_dir() or files.old_dir_for(path).is_dir():
        return "a step directory without a complete checkpoint"
    return None


def _check_same_run(policy: SaveResumePolicy, info: ckpt.CheckpointInfo) -> None:
    run = info.run
    name = info.path.name
    if not isinstance(run, dict) or run.get("format") != _RUN_FORMAT or not run.get("id"):
        raise ckpt.CheckpointMismatchError(
            f"--resume: {info.path} records no zbuf train run (it was saved by "
            f"zbuf.save_checkpoint directly, or by an older zbuf), so this run cannot tell "
            f"whether it is its own, and resumes only its own. Give another --checkpoint-dir "
            f"for a new run")
    theirs, ours = run.get("definition") or {}, policy.run or {}
    differ = [k for k in sorted(set(theirs) | set(ours))
              if theirs.get(k) != ours.get(k) and k not in policy.allow_change]
    if differ:
        listed = "; ".join(f"--{k} {_show(theirs.get(k))} there, {_show(ours.get(k))} here"
                           for k in differ)
        raise ckpt.CheckpointMismatchError(
            f"--resume: {name} belongs to a run with other settings: {listed}. Resume with that "
            f"run's settings, pass --allow-change {','.join(differ)} to change them on purpose, "
            f"or give another --checkpoint-dir for a new run")


def _check_nothing_later(policy: SaveResumePolicy, info: ckpt.CheckpointInfo,
                         found: list[tuple[int, Path]]) -> None:
    """Refuses another run's checkpoints after the one resumed (``--resume-from`` sets this
    run's aside; after the newest there are none): this run would meet them at their steps, and
    they would outrank its own on a later ``--resume``."""
    later = [p for s, p in found if s > info.step and _run_id(p) != info.run["id"]]
    if later:
        whose = sorted({f"run {r}" if r else "no zbuf train run" for r in map(_run_id, later)})
        raise ckpt.CheckpointMismatchError(
            f"--resume-from {policy.resume_from}: {_names(later)} in {policy.directory} belong to "
            f"{', '.join(whose)}, not to the run resumed: its saves would meet them at their "
            f"steps, and they would outrank its checkpoints on a later --resume; nothing was "
            f"loaded or moved. Move them out of {policy.directory}, or resume in another "
            f"--checkpoint-dir")


def _set_aside_later(policy: SaveResumePolicy, info: ckpt.CheckpointInfo) -> None:
    """``--resume-from``: move the run's checkpoints after ``info`` into ``superseded/``."""
    if policy.resume_from is None:
        return
    run_id = info.run["id"]
    # A damaged step directory after it goes too: this run's save of that step would replace
    # it, deleting what zbuf cannot tell it wrote.
    later = [p for s, p in ckpt.list_checkpoints(policy.directory)
             if s > info.step and _run_id(p) == run_id] + \
        [p for s, p, _ in files.damaged_checkpoints(policy.directory) if s > info.step]
    if not later:
        return
    dest = Path(policy.directory) / SUPERSEDED_DIR
    dest.mkdir(exist_ok=True)
    moved = []
    for p in later:
        name = p.name.removeprefix(".").removesuffix(".old")  # a .step_N.old leftover is step_N
        target, n = dest / name, 1
        while target.exists():
            target, n = dest / f"{name}.{n}", n + 1
        shutil.move(str(p), target)
        moved.append(target.name)
    print(f"zbuf: resuming from {info.path.name}; moved this run's later checkpoint(s) "
          f"{', '.join(moved)} to {dest} (they would outrank the checkpoints this run writes "
          f"now)", file=sys.stderr, flush=True)


def _damaged(policy: SaveResumePolicy, damaged: Path, problem: str) -> ckpt.CheckpointCorruptError:
    """The refusal to resume from a damaged checkpoint: which one, what is wrong, and the way
    back, the run's previous complete checkpoint (``way_back``), if there is one."""
    name = damaged.name.removeprefix(".").removesuffix(".old")
    earlier = [p for s, p in ckpt.list_checkpoints(policy.directory) if s < _step_of_name(name)]
    said = (f"--resume: {name} in {policy.directory} is damaged ({problem}); nothing was loaded "
            f"or deleted")
    if not earlier:
        return ckpt.CheckpointCorruptError(
            f"{said}. No earlier checkpoint is left there: give another --checkpoint-dir to start "
            f"afresh", problem=problem)
    back = earlier[-1].name
    return ckpt.CheckpointCorruptError(f"{said}. {way_back(back)}", problem=said, way_back=back)


def way_back(name: str, command: Optional[str] = None) -> str:
    """The advice of a refused resume whose run has an earlier checkpoint ``name``: the option
    that takes it, or the whole ``command`` line when the caller knows it (``zbuf train``)."""
    return f"To resume from the previous checkpoint {name}: {command or f'--resume-from {name}'}"


def _run_id(path: Path) -> Optional[str]:
    """The run id a checkpoint records, or None (unreadable, or no zbuf train run)."""
    try:
        run = ckpt.read_checkpoint_info(path).run
    except ckpt.CheckpointError:
        return None
    return run.get("id") if isinstance(run, dict) else None


def _step_of_name(name: str | int) -> int:
    """``step_00000005``, ``step_5`` or ``5`` -> 5; ``ValueError`` otherwise."""
    text = str(name).rstrip("/").rsplit("/", 1)[-1]
    digits = text.removeprefix("step_")
    if not digits.isdigit():
        raise ValueError(f"--resume-from {name}: expected a checkpoint name such as step_00000005 "
                         f"or a step number such as 5")
    return int(digits)


def _names(paths: list[Path]) -> str:
    names = [p.name for p in paths]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _show(value: Any) -> str:
    return "(unset)" if value is None else str(value)


def _group_of(model: nn.Module) -> dist.ProcessGroup:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return layout.inventory(model).group  # raises the save/load message for unsharded models
