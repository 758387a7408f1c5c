"""Run records without running anything: summaries, markdown, merging, and the report's plots
(including the per-node schedule profile that CPU runs may not produce)."""

import dataclasses
import json
import os

import pytest

from zbuf.cli import main
from zbuf.train.config import Engine, TrainConfig
from zbuf.train.record import SCHEMA, make_record, markdown, merge_records
from zbuf.train.report import make_plots, phases_table, replan_phases_table, schedule_table


def _engine(name, times, losses, pool=False, schedule=None):
    steps = [{"step": i, "loss": l, "time_s": t, "tokens": 2048, "device_bytes": (1 + i) << 28,
              "peak_device_bytes": (2 + i) << 28, "pool_bytes": (64 << 20) if pool else 0,
              "alloc_retries": [0, i]} for i, (t, l) in enumerate(zip(times, losses))]
    per_rank = [{"rank": r, "peak_device_bytes": (3 + r) << 30, "allocated_peak_bytes": 1 << 30,
                 "pool_high_water_bytes": (64 << 20) if pool else 0, "alloc_retries_total": r * 3,
                 "alloc_retries_measured": r * 2, "measured_steps": len(times) - 2}
                for r in range(2)]
    return {"engine": name, "status": "ok", "steps": steps, "per_rank": per_rank,
            "setup_seconds": 1.0, "memory_cap": None, "schedule": schedule,
            "pool": {"hits": 90, "misses": 10, "high_water_bytes": 64 << 20,
                     "budget_bytes": 1 << 30} if pool else {}}


def _record(engines, cfg=None):
    cfg = cfg or TrainConfig(engines=tuple(Engine(e["engine"]) for e in engines), warmup=2,
                             steps=6, micro_batch=1, seq_len=1024).resolve(cuda=True, world=2,
                                                                           bench=True)
    env = {"device_type": "cuda", "torch": "2.11.0", "gpu": "NVIDIA H200", "gpu_count": 2,
           "nccl": "2.28", "driver": "580", "cuda": "13.0"}
    return make_record("bench", cfg, env, engines, peak_flops=989e12)


SCHEDULE = {"graphs": [
    {"graph_id": 0, "kind": "forward", "budget_bytes": 3 << 20, "peak_live_gathered_bytes": 2 << 20,
     "activation_peak_bytes": 5 << 20, "persistent_bytes": 1 << 20, "num_nodes": 5,
     "modelled_compute_seconds": 0.4, "modelled_exposed_seconds": 0.0125,
     "live_gathered_profile": [0, 1 << 20, 2 << 20, 1 << 20, 0],
     "activation_profile": [1 << 20, 2 << 20, 5 << 20, 3 << 20, 1 << 20]},
    {"graph_id": 1, "kind": "backward", "budget_bytes": 3 << 20, "peak_live_gathered_bytes": 1 << 20,
     "num_nodes": 3, "live_gathered_profile": [1 << 20, 0, 0]}]}


def test_summary_statistics_and_markdown():
    times = [30.0, 2.0, 1.0, 1.2, 0.9, 1.1]
    rec = _record([_engine("fsdp2", times, [5, 4, 3, 2.5, 2.2, 2.0]),
                   _engine("zbuf", [t * 0.9 for t in times], [5, 4, 3, 2.5, 2.2, 2.1],
                           pool=True, schedule=SCHEDULE)])
    s = rec["engines"][0]["summary"]
    assert s["measured_steps"] == 4 and s["step_time_median_s"] == pytest.approx(1.05)
    assert (s["step_time_min_s"], s["step_time_max_s"], s["first_step_s"]) == (0.9, 1.2, 30.0)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(1024 / 1.05)
    fpt = rec["model"]["flops_per_token"]
    assert s["mfu"] == pytest.approx(fpt * 1024 / 1.05 / 989e12)
    assert s["peak_device_bytes"] == 4 << 30 and s["alloc_retries_per_rank"] == [0, 2]
    # Rank 1 retried once a step: steps 3 to 5 count after step 2, step 2's own does not.
    assert s["alloc_retries_after_step_2_per_rank"] == [0, 3]
    z = rec["engines"][1]["summary"]
    assert z["schedule_budget_bytes"] == 3 << 20 and z["schedule_peak_live_bytes"] == 2 << 20
    assert z["pool"]["hits"] == 90
    md = markdown(rec)
    assert "2 x NVIDIA H200" in md and "NCCL 2.28" in md and "2 warm-up + 4 measured" in md
    assert md.count("\n| ") == 4  # header, rule, two engines
    json.dumps(rec)  # the record is plain JSON


def test_time_to_the_final_plan_counts_through_the_last_replan():
    """Issue 21's measure: from set-up to the end of the first step that ran the plan kept
    (a re-plan's step compiles again, so it counts), not only the first step."""
    eng = _engine("zbuf", [3, 2, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2])
    assert _record([eng])["engines"][0]["summary"]["time_to_final_plan_s"] == 1.0 + 3
    eng = _engine("zbuf", [3, 2, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2])
    eng["steps"][1]["replanned"] = [True, True]
    summary = _record([eng])["engines"][0]["summary"]
    assert summary["time_to_final_plan_s"] == 1.0 + 3 + 2
    assert summary["first_step_s"] == 3


def _phases(step, first_step_s, first_run, rank_scale=1.0):
    phases = {"dynamo": 1.0, "aot": 2.0, "zbuf": 0.0, "inductor": 3.0, "kernel_compile": 4.0}
    phases = {k: v * rank_scale for k, v in phases.items()}
    phases["first_run"] = first_run
    return {"first_step_s": first_step_s, "phases": phases, "step": step,
            "caches": {"fxgraph_hit": 0, "fxgraph_miss": 2, "aot_hit": 0, "aot_miss": 1}}


def test_report_shows_each_replan_compile_against_the_first():
    """Issue 21: ``zbuf report`` shows the time to the final plan, and each later step that
    compiled (a re-plan) by phase, the slowest rank's, with its compile (the step less its own
    run) as a share of the first step's compile."""
    eng = _engine("zbuf", [20, 10, 3, 5, 3, 3], [5, 4, 3, 2, 1.5, 1.2])
    eng["steps"][3]["replanned"] = [True, True]
    eng["compile_phases"] = [_phases(0, 20.0, 6.0), _phases(0, 19.0, 6.0)]
    # Rank 1's step-1 recompile was the slower; step 3's only rank 0 recorded.
    eng["recompile_phases"] = [[_phases(1, 9.0, 2.0), _phases(3, 5.0, 2.6)],
                               [_phases(1, 10.0, 3.0)]]
    rec = _record([eng])
    cells = {t.title: {row: [c[i] for c in [list(col.cells) for col in t.columns[1:]]]
                       for i, row in enumerate(t.columns[0].cells)}
             for t in (phases_table(rec), replan_phases_table(rec))}
    first = cells["first step by phase (slowest rank)"]
    assert first["time to the final plan"] == [f"{1.0 + 20 + 10 + 3 + 5:.2f} s"]
    replans = replan_phases_table(rec)
    # steps numbered from 1, as the console numbers them (the record's 1 and 3)
    assert [c.header for c in replans.columns[1:]] == ["zbuf step 2 (rank 1)", "zbuf step 4 (rank 0)"]
    rows = cells["re-plan compiles by phase (slowest rank)"]
    assert rows["step (compile + run)"] == ["10.00 s", "5.00 s"]
    assert rows["compile (step less its run)"] == ["7.00 s", "2.40 s"]
    assert rows["of the first step's compile"] == ["50 %", "17 %"]  # of 20 - 6 = 14 s
    assert rows["AOT cache hit/miss"] == ["0 / 1", "0 / 1"]
    del eng["recompile_phases"]
    assert replan_phases_table(_record([eng])) is None  # nothing re-compiled: no table


def test_report_plots_schedule_profiles(tmp_path):
    rec = _record([_engine("zbuf", [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2], pool=True,
                           schedule=SCHEDULE)])
    paths = make_plots(rec, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == [
        "loss.png", "memory.png", "schedule_memory.png", "step_time.png"]
    table = schedule_table(rec)
    assert table.row_count == 17
    forward = list(table.columns[1].cells)
    assert "400.0 ms" in forward and "12.5 ms" in forward  # modelled compute, exposed gathers
    failed = dict(rec, engines=[{"engine": "zbuf", "status": "failed", "error": "OOM"}])
    with pytest.raises(ValueError, match="no engine that completed"):
        make_plots(failed, str(tmp_path))
    assert "failed: OOM" in markdown(failed)


def test_merge_records(tmp_path, capsys):
    a = _record([_engine("fsdp2", [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 1])])
    b = _record([_engine("zbuf", [3, 1, 1, 1, 1, 0.9], [5, 4, 3, 2, 1, 1], pool=True)])
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    merged = merge_records([str(pa), str(pb)])
    assert merged["schema"] == SCHEMA and [e["engine"] for e in merged["engines"]] == ["fsdp2",
                                                                                       "zbuf"]
    assert main(["bench", "--merge", str(pa), str(pb), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["engines"] == ["fsdp2", "zbuf"]
    assert "| zbuf |" in (tmp_path / "all.md").read_text()
    assert "relative to fsdp2" in capsys.readouterr().out

    other = dict(b, config=dict(b["config"], seq_len=2048))
    po = tmp_path / "other.json"
    po.write_text(json.dumps(other))
    assert main(["bench", "--merge", str(pa), str(po), "--out", str(out)]) == 2
    assert "seq_len" in capsys.readouterr().err
    assert main(["bench", "--merge", str(pa), str(pa), "--out", str(out)]) == 2
    assert "repeat" in capsys.readouterr().err


def test_a_record_from_before_the_budget_split_still_merges(tmp_path):
    # Records written before --budget became --gather-budget and --pool-budget carry "budget"
    # and neither new field; each engine's budget is free to differ, so they merge as before.
    old = _record([_engine("fsdp2", [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 1])])
    cfg = {k: v for k, v in old["config"].items() if k not in ("gather_budget", "pool_budget")}
    old["config"] = dict(cfg, budget=1 << 30)
    new = _record([_engine("zbuf", [3, 1, 1, 1, 1, 0.9], [5, 4, 3, 2, 1, 1], pool=True)],
                  TrainConfig(engines=(Engine.ZBUF,), warmup=2, steps=6, micro_batch=1,
                              seq_len=1024, gather_budget=8 << 30).resolve(cuda=True, world=2,
                                                                           bench=True))
    assert new["config"]["gather_budget"] == 8 << 30 and "budget" not in new["config"]
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, rec in zip(paths, (old, new)):
        path.write_text(json.dumps(rec))
    merged = merge_records([str(p) for p in paths])
    assert [e["engine"] for e in merged["engines"]] == ["fsdp2", "zbuf"]
    assert "zbuf" in markdown(merged)
    # What must match still must: the old record's other fields are compared as ever.
    paths[0].write_text(json.dumps(dict(old, config=dict(old["config"], seq_len=2048))))
    with pytest.raises(ValueError, match="seq_len"):
        merge_records([str(p) for p in paths])


def test_fewer_layers_of_a_preset_are_recorded_and_refuse_to_merge(tmp_path):
    # A large preset's harness on a small machine: same layer shape, fewer layers, and a record
    # that says so (and will not be merged with a run of the whole model).
    base = dict(engines=(Engine.ZBUF,), warmup=2, steps=6, micro_batch=1, seq_len=1024,
                preset="qwen3-14b")
    cut = TrainConfig(layers=4, **base).resolve(cuda=True, world=2, bench=True)
    full = TrainConfig(**base).resolve(cuda=True, world=2, bench=True)
    shape = cut.model_config()
    assert shape.num_layers == 4 and full.model_config().num_layers == 40
    assert dataclasses.replace(shape, num_layers=40) == full.model_config()
    eng = _engine("zbuf", [1.0] * 6, [5.0] * 6)
    rec_cut, rec_full = _record([eng], cut), _record([dict(eng)], full)
    assert rec_cut["model"]["name"] == "qwen3-14b, 4 layers"
    assert rec_cut["model"]["shape"]["num_layers"] == 4
    assert rec_cut["model"]["params"] < rec_full["model"]["params"] / 5
    assert TrainConfig.from_json(rec_cut["config"]) == cut
    paths = []
    for name, rec in (("cut", rec_cut), ("full", rec_full)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="layers"):
        merge_records([str(p) for p in paths])


def _table_text(record):
    from rich.console import Console

    from zbuf.train.progress import summary_table

    console = Console(width=300, record=True)
    console.print(summary_table(record))
    return " ".join(console.export_text().split())  # the title wraps to the table's width


def test_summary_table_words():
    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    # zbuf-eager compiles nothing: its first step is no "compile".
    eager = _table_text(_record([_engine("zbuf-eager", times, losses, pool=True)]))
    assert "first step " in eager and "(compile)" not in eager, eager
    mixed = _table_text(_record([_engine("zbuf", times, losses), _engine("zbuf-eager", times,
                                                                          losses)]))
    assert "(compile)" not in mixed
    compiled = _table_text(_record([_engine("zbuf", times, losses), _engine("ddp", times, losses)]))
    assert "first step (compile)" in compiled
    assert "4 measured steps" in compiled and "loss (mean over ranks)" in compiled
    # One measured step is "1 measured step".
    cfg = TrainConfig(engines=(Engine.ZBUF,), steps=2, micro_batch=1,
                      seq_len=1024).resolve(cuda=True, world=2, bench=False)
    one = _table_text(_record([_engine("zbuf", times[:2], losses[:2])], cfg))
    assert "1 measured step" in one and "1 measured steps" not in one, one


def _recompute_stats(mode, kept, sel, recomputed, kept_bytes, recomputed_flops):
    return {"mode": mode, "regions": kept + sel + recomputed, "regions_recomputed": recomputed,
            "regions_selective": sel, "regions_kept": kept, "activation_budget_bytes": 8 << 30,
            "requested_activation_budget_bytes": 8 << 30, "activation_peak_bytes": 6 << 30,
            "kept_bytes": kept_bytes, "recomputed_bytes": 1 << 30, "forward_flops": 4e13,
            "recomputed_flops": recomputed_flops, "partitions": 3}


def test_summary_table_recompute_rows_follow_the_mode():
    # --ac off checkpoints no block: "activations kept / recomputed 34.63 MiB / 512.00 KiB"
    # beside "recomputed FLOP 0" was not true of it; what forward kept for backward is.
    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    off = _recompute_stats("checkpointed", 0, 0, 0, 34 << 20, 0.0)
    text = _table_text(_record([_engine("zbuf", times, losses, schedule={"graphs": [
        dict(g, recompute=off) for g in SCHEDULE["graphs"]]})]))
    assert "activations kept for backward │ 34.00 MiB" in text, text
    assert "recomputed" not in text and "blocks kept" not in text, text
    auto = _recompute_stats("auto", 1, 2, 1, 3 << 30, 5e12)
    text = _table_text(_record([_engine("zbuf", times, losses, schedule={"graphs": [
        dict(g, recompute=auto) for g in SCHEDULE["graphs"]]})]))
    assert "blocks kept/selective/recomputed │ 1/2/1" in text, text
    assert "activations kept / recomputed │ 3.00 GiB / 1.00 GiB" in text, text
    assert "recomputed TFLOP per step │ 5.00 of 40.00" in text, text


def test_the_plan_in_force_is_reported_and_the_replaced_one_apart(tmp_path):
    """Issue 37: ``--ac auto``'s summary and recompute.png added the measured step's plan (every
    block recomputed) to the re-planned one (every block kept): "4/0/4" for a 4-block model."""
    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    measured = _recompute_stats("auto", 0, 0, 4, 3 << 20, 2e9)
    grown = _recompute_stats("auto", 4, 0, 0, 34 << 20, 0.0)
    graphs = [dict(g, graph_id=g["graph_id"] + 2 * plan, plan=plan, recompute=stats,
                   budget_bytes=(3 << 20) * (1 + 9 * plan))
              for plan, stats in ((0, measured), (1, grown)) for g in SCHEDULE["graphs"]]
    rec = _record([_engine("zbuf", times, losses, schedule={"graphs": graphs})])
    summary = rec["engines"][0]["summary"]
    assert summary["recompute"]["regions_kept"] == 4 and summary["recompute"]["regions"] == 4
    assert summary["recompute"]["kept_bytes"] == 34 << 20
    assert summary["schedule_budget_bytes"] == 30 << 20  # the plan in force's
    assert [r["regions_recomputed"] for r in summary["recompute_replaced"]] == [4]
    text = _table_text(rec)
    assert "blocks kept/selective/recomputed │ 4/0/0" in text, text
    assert "activations kept / recomputed │ 34.00 MiB / 1.00 GiB" in text, text
    assert "before the re-plan: blocks │ 0/0/4" in text, text
    assert "before the re-plan: kept / recomputed │ 3.00 MiB / 1.00 GiB" in text, text
    headers = [c.header for c in schedule_table(rec).columns[1:]]
    assert headers == ["zbuf forward #0 (replaced)", "zbuf backward #1 (replaced)",
                       "zbuf forward #2", "zbuf backward #3"], headers
    figs = drawn_figures(rec, tmp_path)
    ax = figs["recompute.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "zbuf\nmeasured step\n(replaced)", "zbuf\nfinal plan"]
    kept = [p.get_height() for p in ax.patches[:2]]  # "kept for backward", in GiB
    assert kept == [3 / 1024, 34 / 1024], kept


def drawn_figures(record, out_dir):
    """The figures make_plots draws, by file name, before they are closed."""
    import zbuf.train.report as report

    figs = {}

    def keep(fig, path):
        figs[os.path.basename(path)] = fig
        return path

    orig = report._save
    report._save = keep
    try:
        report.make_plots(record, str(out_dir))
    finally:
        report._save = orig
    return figs


def test_recompute_in_summary_table_plot_and_merge(tmp_path, capsys, monkeypatch):
    """What zbuf kept and recomputed reaches the summary, the schedule table and recompute.png;
    runs of different --ac modes merge into one comparison, labelled by mode, against FSDP2
    with full checkpointing."""
    stats = _recompute_stats("auto", 1, 2, 1, 3 << 30, 5e12)
    sched = {"graphs": [dict(g, recompute=stats) for g in SCHEDULE["graphs"]]}
    times = [3, 1, 1, 1, 1, 1]
    records = []
    for engine, ac, schedule in (("zbuf", "auto", sched), ("fsdp2", "selective", None),
                                 ("fsdp2", "full", None)):
        cfg = TrainConfig(engines=(Engine(engine),), ac=ac, warmup=2, steps=6, micro_batch=1,
                          seq_len=1024).resolve(cuda=True, world=2, bench=True)
        eng = dict(_engine(engine, times, [5, 4, 3, 2, 1, 1], pool=engine == "zbuf",
                           schedule=schedule), ac=ac, label=engine)
        records.append(_record([eng], cfg))
    z = records[0]["engines"][0]["summary"]["recompute"]
    assert (z["mode"], z["regions_kept"], z["regions_selective"], z["kept_bytes"],
            z["recomputed_flops"]) == ("auto", 1, 2, 3 << 30, 5e12)
    paths = []
    for i, r in enumerate(records):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    merged = merge_records([str(p) for p in paths])
    assert [e["label"] for e in merged["engines"]] == ["zbuf:auto", "fsdp2:selective",
                                                       "fsdp2:full"]
    assert merged["config"]["engine_ac"] == ["auto", "selective", "full"]
    out = tmp_path / "all.json"
    monkeypatch.setenv("COLUMNS", "200")  # the tables unwrapped
    assert main(["bench", "--merge", *map(str, paths), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "relative to fsdp2:full" in printed and "blocks kept/selective/recomputed" in printed
    md = (tmp_path / "all.md").read_text()
    assert "| fsdp2:selective |" in md and "AC per engine" in md
    table = schedule_table(merged)
    labels = [c.plain if hasattr(c, "plain") else str(c) for c in table.columns[0]._cells]
    assert "recomputed FLOPs" in labels and "blocks selective" in labels
    assert table.columns[1]._cells[labels.index("blocks selective")] == "2"
    # one unit for every FLOP count of the table (it mixed "67,108,864" and "0.003 T")
    assert table.columns[1]._cells[labels.index("recomputed FLOPs")] == "5.00 TFLOP"
    assert table.columns[1]._cells[labels.index("forward FLOPs")] == "40.00 TFLOP"
    assert any(p.endswith("recompute.png") for p in make_plots(merged, str(tmp_path / "plots")))
    # Records of one engine and one mode still refuse to merge twice.
    assert main(["bench", "--merge", str(paths[1]), str(paths[1]), "--out", str(out)]) == 2


def test_comparison_table_baseline_reads_one_and_columns_name_the_device():
    """Issue 37: FSDP2's own row read "to the final plan 1.190x" in the table relative to FSDP2
    (its set-up against its first step alone); a CPU run's columns said tok/s/GPU and peak
    device mem over host memory."""
    from zbuf.train.progress import comparison_table

    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    engines = [_engine("zbuf", times, losses), _engine("fsdp2", times, losses)]
    engines[0]["steps"][2]["replanned"] = [True, True]
    rec = _record(engines)
    table = comparison_table(rec)
    columns = {c.header: list(c._cells) for c in table.columns}
    assert columns["engine"] == ["zbuf", "fsdp2"]
    assert all(cells[1] == "1.000x" for header, cells in columns.items() if header != "engine")
    assert columns["to the final plan"][0] == f"{(1 + 3 + 1 + 1) / (1 + 3):.3f}x"
    assert "tok/s/GPU" in columns and "peak device mem" in columns
    assert "| tok/s/GPU |" in markdown(rec) and "| peak device mem |" in markdown(rec)
    cpu = dict(rec, environment={"device_type": "cpu", "torch": "2.11.0"})
    headers = [c.header for c in comparison_table(cpu).columns]
    assert headers == ["engine", "step time", "tok/s/rank", "peak RSS", "first step",
                       "to the final plan"], headers
    assert "| tok/s/rank |" in markdown(cpu) and "| peak RSS |" in markdown(cpu)
    assert "GPU" not in markdown(cpu).split("\n| engine")[1] and "device" not in \
        markdown(cpu).split("\n| engine")[1]


def test_terminal_tables_at_80_and_160_columns():
    """Issue 37: the summary title wrapped mid-phrase at 80 and 160 columns; "1 ranks"; the
    schedule table cut values at 80 columns ("13494faf321…")."""
    from rich.console import Console

    from zbuf.train.progress import print_table, summary_table
    from zbuf.train.report import _title

    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    graphs = [dict(g, graph_id=i, fingerprint=f"{i:x}" * 16, recompute=_recompute_stats(
        "auto", 1, 2, 1, 3 << 30, 5e12)) for i, g in enumerate(SCHEDULE["graphs"] * 3)]
    rec = _record([_engine("zbuf", times, losses, schedule={"graphs": graphs})])
    for width in (80, 160):
        console = Console(width=width, record=True)
        print_table(console, summary_table(rec))
        title = console.export_text().splitlines()[0].strip()
        assert title == "zbuf bench: qwen3-0.6b, 2 ranks, 1 x 1024 tokens/rank, 4 measured " \
                        "steps", title
    console = Console(width=80, record=True)
    print_table(console, schedule_table(rec))
    text = console.export_text()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines()), text
    for g in graphs:
        assert f" {g['fingerprint']} " in text, g["fingerprint"]
    assert "(continued)" in text  # six graphs do not fit 80 columns: two tables or more
    one = dict(rec, world_size=1)
    assert "1 rank," in _title(one, "Loss") and "1 ranks" not in _title(one, "Loss")
    console = Console(width=160, record=True)
    print_table(console, summary_table(one))
    assert "1 rank," in console.export_text() and "1 ranks" not in console.export_text()
    assert "1 rank," in markdown(one)


def test_plots_number_steps_as_the_console_and_keep_every_line_visible(tmp_path):
    """Issue 37: plots showed steps 0-29 of a run the console showed as 1-30; the step-time axis
    read "6x10^3", not ms; both engines' pool high-water lines were the same grey; a legend
    covered the backward graph's curve; identical loss curves hid one another."""
    import matplotlib.colors as mcolors

    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    engines = [_engine(name, [t * 6 for t in times], losses, pool=True, schedule=SCHEDULE)
               for name in ("zbuf", "zbuf-eager")]
    engines[1]["pool"]["high_water_bytes"] = 32 << 20
    figs = drawn_figures(_record(engines), tmp_path)
    loss = figs["loss.png"].axes[0]
    assert [list(line.get_xdata()) for line in loss.lines] == [[1, 2, 3, 4, 5, 6]] * 2
    styles = {(line.get_linestyle(), line.get_marker()) for line in loss.lines}
    assert len(styles) == 2, styles  # the same numbers, two lines that both show
    step = figs["step_time.png"].axes[0]
    figs["step_time.png"].canvas.draw()
    ticks = [t.get_text() for t in step.get_yticklabels(which="both") if t.get_text()]
    assert ticks and all("10^" not in t and "times" not in t for t in ticks), ticks
    assert "6,000" in ticks and "10,000" in ticks, ticks  # 6 to 18 s, in ms
    pool = figs["memory.png"].axes[1]
    charged = [line for line in pool.lines if line.get_label().endswith(": charged")]
    high = [line for line in pool.lines if line.get_label().endswith(": high water")]
    assert len(high) == 2
    assert mcolors.to_hex(high[0].get_color()) != mcolors.to_hex(high[1].get_color())
    for c, h in zip(charged, high):
        assert mcolors.to_hex(c.get_color()) == mcolors.to_hex(h.get_color())
    for ax in figs["schedule_memory.png"].axes:
        figs["schedule_memory.png"].canvas.draw()
        legend = ax.get_legend().get_window_extent()
        assert legend.x0 >= ax.get_window_extent().x1, ax.get_title()  # beside, not over


def _one_rank(eng, rank, steps):
    """``eng`` as the rank ``rank`` of a stopped run would have written it: its own rows only
    (per-rank fields one value long), ``per_rank`` one entry numbered 0 (``loop._combine``)."""
    one = dict(eng, status="interrupted", per_rank=[dict(eng["per_rank"][rank], rank=0)])
    one["steps"] = [dict(s, alloc_retries=[s["alloc_retries"][rank]],
                         time_s=s["time_s"] + rank, device_bytes=s["device_bytes"] + rank)
                    for s in eng["steps"][:steps]]
    return one


def test_an_interrupted_run_joins_every_rank_and_plots_what_it_did(tmp_path):
    """Issue 37, item 3: the record of an interrupted run held rank 0 alone (one retry value for
    two ranks), and ``zbuf report`` refused it; now the launcher joins each rank's stopped steps
    ([Note: every rank's stopped steps] in zbuf/train/interrupted.py) and the report plots them."""
    from zbuf.train.interrupted import rank_path, read_stopped

    full = _engine("zbuf-eager", [3, 1, 1, 1], [5, 4, 3, 2], pool=True)
    path = str(tmp_path / "partial.json")
    for rank, steps in ((0, 4), (1, 3)):  # rank 1 stopped a step earlier
        with open(rank_path(path, rank), "w") as f:
            json.dump({"environment": {}, "peak_flops": None,
                       "engines": [_one_rank(full, rank, steps)]}, f)
    eng = read_stopped(path, world=2)["engines"][-1]
    assert [s["step"] for s in eng["steps"]] == [0, 1, 2]  # the steps every rank finished
    assert [s["alloc_retries"] for s in eng["steps"]] == [[0, 0], [0, 1], [0, 2]]
    assert [s["time_s"] for s in eng["steps"]] == [4, 2, 2]  # the slowest rank's
    assert [r["rank"] for r in eng["per_rank"]] == [0, 1] and eng["pool"] == full["pool"]
    rec = _record([eng])
    assert rec["engines"][0]["summary"]["alloc_retries_per_rank"] == [0, 2]
    names = sorted(p.rsplit("/", 1)[1] for p in make_plots(rec, str(tmp_path / "plots")))
    assert names == ["loss.png", "memory.png", "step_time.png"], names
    assert read_stopped(str(tmp_path / "none.json"), world=2) is None


def test_the_blocks_offloaded_to_host_get_a_row_of_their_own():
    """Block frames' levels come from the step memory's re-plan; the kept blocks whose
    activations wait in host memory ([Note: offloaded blocks] in zbuf/compile/block_offload.py)
    are counted apart, and the row is there only when some are."""
    times, losses = [3, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1.5, 1.2]
    texts = []
    for offloaded in (0, 3):
        levels = dict(_recompute_stats("auto", 4, 1, 3, 3 << 30, 5e12),
                      regions_offloaded=offloaded)
        engine = _engine("zbuf", times, losses)
        engine["step_memory"] = {"measured": {"recompute": levels, "replanned": True}}
        texts.append(_table_text(_record([engine])))
    assert "blocks kept/selective/recomputed │ 4/1/3" in texts[0], texts[0]
    assert "offloaded to host" not in texts[0], texts[0]
    assert "of them offloaded to host │ 3" in texts[1], texts[1]
