"""The first step's compile record says why a cache was bypassed ([Note: why a cache was
bypassed] in zbuf/train/compile_phases.py): a bypass rules out a warm start, and torch's counter
alone does not say what to fix."""

from __future__ import annotations

import logging

import torch

from zbuf.train.compile_phases import PhaseClock


def _first_step(**inductor_config):
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.tanh(x) * 2 + 1, backend="inductor")
    with torch._inductor.config.patch(**inductor_config):
        with PhaseClock() as clock:
            f(torch.randn(8))
    return clock.result(1.0)


def _uncacheable_pass(graph: torch.fx.Graph) -> None:
    """A post-grad pass without a uuid: Inductor cannot key its cache on it."""


def test_the_reasons_of_both_bypasses_are_recorded_and_nothing_is_printed(tmp_path, monkeypatch,
                                                                          capfd):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    got = _first_step()
    assert got.caches["fxgraph_miss"] >= 1 and got.cache_bypass_reasons == []

    loggers = [logging.getLogger(n) for n in ("torch._inductor.codecache",
                                              "torch._functorch._aot_autograd.autograd_cache")]
    levels = [lg.level for lg in loggers]
    for config, counter, reason in (
            (dict(post_grad_custom_post_pass=_uncacheable_pass), "fxgraph_bypass",
             "Unsupported post grad custom pass"),
            (dict(fx_graph_cache=False), "aot_bypass", "FX graph cache is not enabled")):
        got = _first_step(**config)
        assert got.caches[counter] >= 1
        assert any(reason in r for r in got.cache_bypass_reasons), got.cache_bypass_reasons
        assert got.to_json()["cache_bypass_reasons"] == got.cache_bypass_reasons

    assert "Bypassing" not in capfd.readouterr().err  # INFO lines kept, not shown
    assert [lg.level for lg in loggers] == levels  # the loggers as they were
    assert not any(lg.filters for lg in loggers)



def test_the_record_names_the_timers_a_phase_is_made_of(tmp_path, monkeypatch):
    """Each ``dynamo_timed`` key's own time in the step, longest first: the phases are
    differences of spans, so only the keys say which span inside a phase took its time."""
    from zbuf.train.compile_phases import TIMER_FLOOR_S

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    got = _first_step()
    timers = got.timers
    assert list(timers.values()) == sorted(timers.values(), reverse=True)
    assert min(timers.values()) >= TIMER_FLOOR_S
    # The frame's whole compile holds Dynamo's share; Inductor's compile holds its own phase.
    assert timers["_compile.compile_inner"] >= got.phases["dynamo"]
    assert timers["compile_fx_inner"] >= got.phases["inductor"]
    assert got.to_json()["timers"] == timers
    with PhaseClock() as clock:  # a step that compiles nothing times nothing
        pass
    assert clock.result(0.0).timers == {}
