"""SaveResumePolicy: what ``zbuf train --checkpoint-dir D --save-every N --resume`` does per step.

In this process on a one-rank gloo group; the multi-rank, fresh-process resume is in
test_checkpoint.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import zbuf.checkpoint as ckpt
from zbuf.train.save_resume import SaveResumePolicy


pytestmark = pytest.mark.usefixtures("one_rank_group")  # conftest.py


def _make():
    from zbuf.shard import shard

    torch.manual_seed(0)
    model = shard(nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 2)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # data is a function of the step, as in zbuf.train
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


RUN = {"lr": 0.01, "seed": 0, "task": "stride"}


def _policy(root, **kw) -> SaveResumePolicy:
    kw.setdefault("run", RUN)
    return SaveResumePolicy(directory=str(root), **kw)


def _run(policy: SaveResumePolicy, total: int, stop_after=None):
    model, opt = _make()
    run = policy.begin(model, opt)
    for step in range(run.start_step, total if stop_after is None else stop_after):
        _step(model, opt, step)
        run.after_step(step + 1, model, opt)
    return run, model, opt


def _flat(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [st[k].clone() for k in sorted(st)]
    return out


def _steps(root) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(root)]


def _same(a, b) -> bool:
    a, b = _flat(*a), _flat(*b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_save_every_prune_and_bit_exact_resume(tmp_path):
    root = tmp_path / "ck"
    policy = _policy(root, save_every=2, resume=True, keep_last=2, total_steps=7)

    _, ref_model, ref_opt = _run(SaveResumePolicy(), 7)  # no checkpoints at all
    assert not root.exists()

    first, _, _ = _run(policy, 7, stop_after=5)  # "killed" after step 5
    assert first.start_step == 0 and first.run_id
    assert _steps(root) == [2, 4]

    run, model, opt = _run(policy, 7)  # the restart: same command line
    assert run.start_step == 4 and run.run_id == first.run_id
    assert _steps(root) == [6, 7]  # the final step is saved too
    assert _same((ref_model, ref_opt), (model, opt))
    info = ckpt.read_checkpoint_info(root)
    assert info.step == 7 and info.run["id"] == first.run_id and info.run["definition"] == RUN


def test_resume_without_checkpoints_starts_fresh(tmp_path):
    policy = _policy(tmp_path / "empty", resume=True)
    model, opt = _make()
    run = policy.begin(model, opt)
    assert run.start_step == 0 and run.resumed_from is None
    assert run.after_step(3, model, opt) is None  # no save_every: never saves


def test_disabled_policy_does_nothing(tmp_path):
    model, opt = _make()
    policy = SaveResumePolicy()
    assert not policy.enabled
    run = policy.begin(model, opt)
    assert run.start_step == 0 and run.after_step(10, model, opt) is None


def test_a_new_run_refuses_a_directory_with_checkpoints(tmp_path):
    root = tmp_path / "ck"
    _run(_policy(root, save_every=2), 4)
    model, opt = _make()
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        _policy(root, save_every=2).begin(model, opt)  # no resume: a new run
    msg = str(e.value)
    assert "step_00000002, step_00000004" in msg and "--resume" in msg and "empty" in msg, msg
    assert _steps(root) == [2, 4]


def test_resume_refuses_other_settings_unless_allowed(tmp_path):
    root = tmp_path / "ck"
    first, _, _ = _run(_policy(root, save_every=2, keep_last=5), 4)
    other = {"lr": 0.02, "seed": 1, "task": "copy"}
    model, opt = _make()
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        _policy(root, resume=True, run=other).begin(model, opt)
    msg = " ".join(str(e.value).split())
    for part in ("--lr 0.01 there, 0.02 here", "--seed 0 there, 1 here",
                 "--task stride there, copy here", "--allow-change lr,seed,task"):
        assert part in msg, msg
    with pytest.raises(ckpt.CheckpointMismatchError, match="--task stride there"):
        _policy(root, resume=True, run=other, allow_change=("lr", "seed")).begin(model, opt)
    # Allowed on purpose: the run goes on under its id, and records its new settings.
    run, _, _ = _run(_policy(root, resume=True, save_every=2, keep_last=5, run=other,
                             allow_change=("lr", "seed", "task")), 6)
    assert run.start_step == 4 and run.run_id == first.run_id
    info = ckpt.read_checkpoint_info(root)
    assert info.step == 6 and info.run["definition"] == other and info.run["id"] == first.run_id


def test_retention_never_deletes_what_the_run_did_not_write(tmp_path):
    root = tmp_path / "ck"
    _run(_policy(root, save_every=2), 2)
    model, opt = _make()
    foreign = ckpt.save_checkpoint(ckpt.checkpoint_path(root, 1), model, opt, step=1)  # not this run's
    _run(_policy(root, resume=True, save_every=2, keep_last=1), 8)
    assert _steps(root) == [1, 8] and foreign.is_dir()
    # A checkpoint without a run record is not resumed by zbuf train either.
    lone = tmp_path / "lone"
    ckpt.save_checkpoint(ckpt.checkpoint_path(lone, 3), model, opt, step=3)
    with pytest.raises(ckpt.CheckpointMismatchError, match="records no zbuf train run"):
        _policy(lone, resume=True).begin(model, opt)


def test_resume_from_an_older_checkpoint_when_the_newest_is_damaged(tmp_path, capfd):
    root = tmp_path / "ck"
    _, ref_model, ref_opt = _run(SaveResumePolicy(), 8)
    _run(_policy(root, save_every=2, keep_last=3), 6)
    assert _steps(root) == [2, 4, 6]
    data = next(p for p in (root / "step_00000006").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    model, opt = _make()
    with pytest.raises(ckpt.CheckpointCorruptError, match="--resume-from step_00000004"):
        _policy(root, resume=True).begin(model, opt)
    policy = _policy(root, resume=True, resume_from="step_00000004", save_every=2, keep_last=3)
    run, model, opt = _run(policy, 8)
    assert run.start_step == 4 and run.resumed_from.name == "step_00000004"
    assert _same((ref_model, ref_opt), (model, opt))
    assert _steps(root) == [4, 6, 8]  # the new step_6, not the damaged one
    assert (root / "superseded" / "step_00000006").is_dir()
    assert "moved this run's later checkpoint(s) step_00000006" in capfd.readouterr().err
    with pytest.raises(ckpt.CheckpointMismatchError, match="no complete checkpoint step_00000005"):
        _policy(root, resume=True, resume_from="5").begin(model, opt)
    # A newest checkpoint whose manifest cannot be read names the way back too.
    (root / "step_00000008" / ckpt.files.MANIFEST_NAME).write_text("{ cut")
    with pytest.raises(ckpt.CheckpointCorruptError, match="--resume-from step_00000006"):
        _policy(root, resume=True).begin(model, opt)


def test_resume_refuses_a_damaged_newest_checkpoint_and_deletes_nothing(tmp_path):
    """Issue 37, item 2: with every file of the newest checkpoint deleted, ``--resume`` went on
    from the one before in silence, and its save of that step then deleted the damaged
    directory. Now it is refused, naming the step, what is wrong and the way back; resuming from
    there moves the damaged directory aside, whole."""
    root = tmp_path / "ck"
    _run(_policy(root, save_every=2, keep_last=3), 6)
    newest = root / "step_00000006"
    kept = newest / "note.txt"  # what a user left there is not zbuf's to delete
    for f in newest.iterdir():
        f.unlink()
    kept.write_text("mine")
    model, opt = _make()
    with pytest.raises(ckpt.CheckpointCorruptError) as e:
        _policy(root, resume=True).begin(model, opt)
    msg = " ".join(str(e.value).split())
    assert msg.startswith("--resume: step_00000006 in ") and "is damaged (it has no " in msg, msg
    assert "nothing was loaded or deleted" in msg and "--resume-from step_00000004" in msg, msg
    assert e.value.way_back == "step_00000004" and "--resume-from" not in e.value.problem
    # A fresh start sees it as a checkpoint too; a file of the newest missing is refused alike.
    with pytest.raises(ckpt.CheckpointMismatchError, match="step_00000006"):
        _policy(root).begin(model, opt)
    next((root / "step_00000004").glob("*.distcp")).unlink()
    shutil.move(root / "step_00000002", tmp_path / "aside")
    with pytest.raises(ckpt.CheckpointCorruptError, match="distcp is missing") as e:
        _policy(root, resume=True, resume_from="4").begin(model, opt)
    assert e.value.way_back is None and "No earlier checkpoint is left" in str(e.value)
    shutil.move(tmp_path / "aside", root / "step_00000002")
    run, _, _ = _run(_policy(root, resume=True, resume_from="2", save_every=2, keep_last=3), 8)
    assert run.start_step == 2 and _steps(root) == [4, 6, 8]
    assert (root / "superseded" / "step_00000006" / "note.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"save_every": 5}, "need --checkpoint-dir"),
        ({"resume": True}, "need --checkpoint-dir"),
        ({"directory": "d", "save_every": 0}, "save_every must be a positive int"),
        ({"directory": "d", "save_every": True}, "save_every must be a positive int"),
        ({"directory": "d", "keep_last": 0}, "keep_last must be an int >= 1"),
        ({"directory": "d", "resume": "yes"}, "resume must be a bool"),
        ({"directory": ""}, "checkpoint directory must be a path"),
        ({"directory": "d", "resume_from": "step_5"}, "resume_from needs resume=True"),
        ({"directory": "d", "resume": True, "resume_from": "latest"}, "expected a checkpoint name"),
        ({"directory": "d", "run": {"lr": 1}, "allow_change": ("lrr",)}, "choose from lr"),
    ],
)
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SaveResumePolicy(**kwargs)


def test_save_checkpoint_follows_the_cli_ownership_rule(tmp_path):
    # The README's snippet run twice replaced ./ckpt silently, where zbuf train refuses another
    # run's checkpoints: a checkpoint is replaced only by a save of the run that wrote it.
    model, opt = _make()
    path = tmp_path / "ckpt"
    ckpt.save_checkpoint(path, model, opt, step=3)
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        ckpt.save_checkpoint(path, model, opt, step=3)
    msg = " ".join(str(e.value).split())
    assert f"not saving {path}" in msg and "step 3, saved without a run id" in msg, msg
    assert "choose another path" in msg and "run={'id': ...}" in msg, msg
    assert ckpt.read_checkpoint_info(path).run is None  # nothing was written
    mine = tmp_path / "mine"
    ckpt.save_checkpoint(mine, model, opt, step=1, run={"id": "a"})
    with pytest.raises(ckpt.CheckpointMismatchError, match="of run a"):
        ckpt.save_checkpoint(mine, model, opt, step=2, run={"id": "b"})
    ckpt.save_checkpoint(mine, model, opt, step=2, run={"id": "a"})  # its own run: replaced
    assert ckpt.read_checkpoint_info(mine).step == 2


def test_a_run_never_replaces_a_checkpoint_that_appeared_while_it_trained(tmp_path):
    """[Note: checkpoints belong to one run]: two copies of a run resumed from the same
    checkpoint (a requeued job whose first attempt still runs) shared its run id, so the later
    one's save of a step replaced the earlier one's checkpoint of that step. Now the later one
    stops before writing, with one line, and the checkpoint there is as it was."""
    root = tmp_path / "ck"
    _run(_policy(root, save_every=2), 2)
    model, opt = _make()
    run = _policy(root, resume=True, save_every=2).begin(model, opt)  # the second copy
    first, _, _ = _run(_policy(root, resume=True, save_every=2), 6, stop_after=4)
    assert run.start_step == first.start_step == 2 and run.run_id == first.run_id
    held = (root / "step_00000004" / "zbuf-manifest.json").read_bytes()
    _step(model, opt, 2)
    run.after_step(3, model, opt)
    _step(model, opt, 3)
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        run.after_step(4, model, opt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--checkpoint-dir {root}: step_00000004 appeared"), msg
    assert f"(a checkpoint of run {first.run_id})" in msg and "Stopped at step 4" in msg, msg
    assert "nothing there was changed" in msg and "another --checkpoint-dir" in msg, msg
    assert (root / "step_00000004" / "zbuf-manifest.json").read_bytes() == held
    assert _steps(root) == [2, 4] and not list(root.glob(".*"))


def test_resume_from_refuses_another_runs_later_checkpoint_before_loading(tmp_path):
    """Another run's checkpoint after the one resumed from would be met at its step (refused
    mid-run, the steps since the last save lost) and outrank this run's on the next --resume:
    refused before anything is loaded or moved."""
    root = tmp_path / "ck"
    _run(_policy(root, save_every=2, keep_last=3), 6)
    model, opt = _make()
    _step(model, opt, 0)
    foreign = ckpt.save_checkpoint(ckpt.checkpoint_path(root, 5), model, opt, step=5,
                                   run={"id": "someone-else"})
    policy = _policy(root, resume=True, resume_from="step_00000002", save_every=2)
    from zbuf.train.save_resume import resume_point

    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        resume_point(policy)
    msg = str(e.value)
    assert msg.startswith("--resume-from step_00000002: step_00000005 in ") and "\n" not in msg
    assert "belong to run someone-else" in msg and "nothing was loaded or moved" in msg, msg
    before = [p.name for p in root.iterdir()]
    model, opt = _make()
    with pytest.raises(ckpt.CheckpointMismatchError, match="belong to run someone-else"):
        policy.begin(model, opt)
    assert [p.name for p in root.iterdir()] == before and foreign.is_dir()
    assert _steps(root) == [2, 4, 5, 6]
