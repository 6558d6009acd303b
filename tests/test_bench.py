"""``memsem bench`` plumbing and the hot-path guarantees it relies on (cheap; no MPI run)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import memsem
from memsem_bench import main as _bench, measure as M


def test_ref_range_checked_on_cached_resolution():
    # A ref whose range was widened past its window (same key) must not read beyond the
    # window, also once the window's resolution is cached.
    with memsem.Runtime() as rt:
        ref = rt.publish(np.arange(64, dtype=np.uint8))
        ref.get()  # resolution cached
        # (a ref claiming more than its mint does not even build: drop the mint to forge one)
        wide = memsem.TensorRef(dataclasses.replace(ref.spec, nbytes=4096, shape=(4096,), mint=None), rt)
        with pytest.raises(ValueError, match="outside"):
            wide.get()
        shifted = memsem.TensorRef(dataclasses.replace(ref.spec, offset=32, mint=None), rt)
        with pytest.raises(ValueError, match="outside"):
            shifted.put(np.zeros(64, np.uint8))


def test_telemetry_counts_gets_and_puts():
    with memsem.Runtime() as rt:
        ref = rt.publish(np.zeros(1000, np.uint8), access="rw")
        out = np.empty(1000, np.uint8)
        for _ in range(3):
            ref.get(out)
        ref.put(np.ones(1000, np.uint8))
        st = rt.stats()
        route = ref.route().kind
        assert st.ops_by_route[route] == 4
        assert st.bytes_by_route[route] == 4000
        assert st.latency_us["get"]["n"] == 3 and st.latency_us["put"]["n"] == 1
        assert st.bounce_bytes == 0


def test_goal_checks():
    fig = {"get_64B_us": 1.5, "mpi_sendrecv_64B_us": 2.0, "get_64MiB_GBps": 9.0, "copyto_64MiB_GBps": 10.0,
           "view_64MiB_us": 25.0, "pipeline_vs_ideal": None, "bounce_bytes_host": 0}
    assert _bench.goal_met("get_64B_us", fig) is True  # no ratio of rounds: the two medians
    assert _bench.goal_met("get_64MiB_GBps", fig) is True
    assert _bench.goal_met("view_64MiB_us", fig) is False
    assert _bench.goal_met("pipeline_vs_ideal", fig) is None
    assert _bench.goal_met("bounce_bytes_host", fig) is True
    assert _bench.goal_met("get_64B_us", {"get_64B_us": 1.0}) is None  # peer missing: no verdict
    # the ratio of rounds decides where it exists, also for the older absolute key
    fig["get_64B_vs_mpi_sendrecv"] = 1.2
    assert _bench.goal_met("get_64B_us", fig) is False
    assert _bench.goal_met("get_64B_vs_mpi_sendrecv", fig) is False
    assert _bench.goal_met("get_64B_us_16_consumers_ratio", {"get_64B_us_16_consumers_ratio": 9.0}) is None


def test_ratio_of_rounds_is_the_median_of_per_round_ratios():
    num = [10.0, 20.0, 30.0, 40.0, 1000.0]
    den = [10.0, 10.0, 10.0, 10.0, 10.0]
    st = M.ratio_of_rounds(num, den)
    assert st.value == 3.0 and st.rounds == 5  # the outlier round moves p90, not the median
    assert st.p10 < st.value < st.p90
    assert st.keys("k") == {"k": 3.0, "k_spread": st.spread()}
    assert M.RatioStat.of([]).keys("k") == {"k": None, "k_spread": None}
    assert M.round_medians([1, 2, 3, 10, 20, 30], 3) == [2, 20]
    with pytest.raises(ValueError, match="per_round"):
        M.round_medians([1], 0)
    with pytest.raises(ValueError, match="one value per round"):
        M.ratio_of_rounds([1.0], [1.0, 2.0])


def test_tails_are_percentiles_of_every_call_and_their_ratio_pools_the_rounds():
    """Two rounds of 1000 calls each: the get's slow calls (its tail) are 1% of its calls and
    sit in the second round only; np.copyto's calls are all alike."""
    get = [1000.0] * 1000 + [1000.0] * 980 + [50_000.0] * 20
    copy = [500.0] * 2000
    p99, p999 = M.tails_us(get)
    assert p99 == pytest.approx(1.49)  # at the edge of the slow calls (interpolated), in us
    assert p999 == 50.0
    assert M.tails_us([]) == (None, None)
    st = M.tail_ratio(get, copy, 1000)
    assert st.value == pytest.approx(float(np.percentile(get, 99)) / 500.0)
    assert st.rounds == 2 and st.p10 < st.p90  # round 1 has no tail (ratio 2), round 2 does (100)
    assert M.tail_ratio(get, copy, 1000, 99.9).value == 100.0
    assert M.tail_ratio([], copy, 10).value is None
    with pytest.raises(ValueError, match="per_round"):
        M.tail_ratio(get, copy, 0)


def test_sizes_and_paired_sampling():
    assert M.SIZES_FULL[0] == 64 and M.SIZES_FULL[-1] == 256 << 20
    assert all(b == 4 * a for a, b in zip(M.SIZES_FULL, M.SIZES_FULL[1:]))
    assert set(M.SIZES_QUICK) <= set(M.SIZES_FULL) and {64, 64 << 20} <= set(M.SIZES_QUICK)
    calls = []
    out = M.paired({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, per_round=2)
    assert len(out["a"]) == len(out["b"]) == 6
    # one warm-up each, then interleaved round by round, the order reversed every other round
    assert calls[2:] == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    calls.clear()
    M.paired({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2, per_round=1,
             alternate=False)
    assert calls[2:] == ["a", "b", "a", "b"]


def _fake_figures() -> dict:
    fig = {g.key: 1.0 for g in _bench.GOALS_LIST}
    fig.update({f"{g.key}_spread": [0.9, 1.1] for g in _bench.GOALS_LIST})
    fig["gloo_vs_weight_sync_4r"] = None  # a peer missing: skipped, with its reason
    fig["get_64B_us_16_consumers_ratio"] = 1.05
    fig["scale_cpus"] = 2
    return fig


def test_verdicts_name_the_reason_of_a_skip():
    fig = _fake_figures()
    reasons = {"gloo_broadcast_4r_s": "torch is not installed in /x/python"}
    by = {g.key: g for g in _bench.GOALS_LIST}
    assert _bench.verdict(by["gloo_vs_weight_sync_4r"], fig, reasons) == ("skipped", reasons["gloo_broadcast_4r_s"])
    assert _bench.verdict(by["gloo_vs_weight_sync_4r"], fig, {})[0] == "skipped"
    assert _bench.verdict(by["get_64B_us_16_consumers_ratio"], fig, {}) == ("reported", "2 cores")
    assert _bench.verdict(by["get_64B_vs_copyto"], fig, {}) == ("met", "")
    fig["get_64B_vs_copyto"] = 3.0
    assert _bench.verdict(by["get_64B_vs_copyto"], fig, {}) == ("not met", "")


def test_console_shows_every_table_and_goal_and_escapes_markup(tmp_path):
    from rich.console import Console

    fig = _fake_figures()
    fig.update(weight_sync_4r_s=0.2, tcp_get_64B_us=90.0, tcp_link="veth", get_64B_us_at_10k_windows=600.0,
               telemetry_ns_per_op=40.0)
    reasons = {"gloo_broadcast_4r_s": "torch is not installed [torch]"}
    goals = {g.key: dict(zip(("state", "why"), _bench.verdict(g, fig, reasons)), goal=g.text, table=g.table,
                         value=fig.get(g.key), spread=fig.get(f"{g.key}_spread")) for g in _bench.GOALS_LIST}
    s = M.Series("memsem get host/shm", "get", "host/shm", {64: [1000, 1100], 64 << 20: [5_000_000]})
    console = Console(width=100, record=True)
    notes = ["a hint: pip install 'memsem[bench]'"]
    _bench._tables(console, [s], [64, 64 << 20], fig, goals, notes, [], 1.0, tmp_path)
    text = console.export_text()
    for title in ("median latency", "bandwidth", "weight sync", "tcp route", "cost as the work grows", "goals"):
        assert title in text, title
    for g in _bench.GOALS_LIST:
        assert g.key in text, g.key
    assert "gloo_vs_weight_sync_4r: torch is not installed [torch]" in text  # the reason, markup kept
    assert "pip install 'memsem[bench]'" in text
    assert "reported, 2 cores" in text
    assert "met" in text and "issue 2" not in text


@pytest.mark.timeout(1800)  # some 40 processes start (MPI, namespaces, rollouts, gloo, 16 consumers)
def test_smoke_run_prints_every_key_and_one_json_line_last(tmp_path):
    """``memsem bench --quick --json`` end to end with every measurement at its smallest
    (MEMSEM_BENCH_SMOKE=1): the last line of stdout is one JSON object holding every goal key
    and its spread, bench.json holds a verdict per goal and a reason per null; nothing is timed."""
    import json
    import os
    import subprocess
    import sys

    import signal

    env = dict(os.environ, MEMSEM_BENCH_SMOKE="1")
    # its own session: on a timeout the whole group goes (rollouts, gloo ranks, owners), not
    # only the bench process
    p = subprocess.Popen([sys.executable, "-m", "memsem.cli", "bench", "--quick", "--json", "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=1700)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    assert p.returncode == 0, err[-3000:]
    last = out.strip().splitlines()[-1]
    fig = json.loads(last)
    assert isinstance(fig, dict)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["figures"] == fig and report["smoke"] is True
    for key in ("get_64B_us", "mpi_sendrecv_64B_us", "get_64MiB_GBps", "copyto_64MiB_GBps", "view_64MiB_us",
                "tcp_get_64B_us", "socket_rtt_64B_us", "socket_rtt_64B_us_loopback", "tcp_link",
                "weight_sync_4r_s", "gloo_broadcast_4r_s", "ray_object_store_4r_s", "copyto_2stream_GBps",
                "weight_sync_trainer_blocked_ms", "get_64B_us_at_10k_windows", "publish_unpublish_us",
                "publish_unpublish_us_at_10k_windows", "get_64B_us_16_consumers", "lookup_us_redis",
                "lookup_us_redis_10k_names", "scale_cpus"):
        assert key in fig, key
    for g in _bench.GOALS_LIST:
        assert g.key in fig, g.key
        if g.key != "bounce_bytes_host":
            assert f"{g.key}_spread" in fig, g.key
        if fig[g.key] is not None and g.key not in ("bounce_bytes_host", "rss_overhead_MiB"):
            sp = fig[f"{g.key}_spread"]
            assert isinstance(sp, list) and len(sp) == 2 and sp[0] <= sp[1], (g.key, sp)
        state = report["goals"][g.key]["state"]
        assert state in ("met", "not met", "reported", "skipped"), (g.key, state)
        if state == "skipped":
            assert report["goals"][g.key]["why"], g.key
    # the same-node figures always run; the scale figures run with this install's own windows
    for key in ("get_64B_us", "get_64B_vs_copyto", "get_64B_us_at_10k_windows_ratio",
                "publish_unpublish_us_at_10k_windows_ratio", "get_64B_us_16_consumers_ratio"):
        assert isinstance(fig[key], float), (key, fig[key])
    for name in ("goals", "weight sync", "tcp route", "cost as the work grows"):
        assert name in err, name
    assert {"latency.png", "bandwidth.png", "ops.png", "goals.png"} <= {f.name for f in tmp_path.iterdir()}


def test_the_bench_finds_the_checkout_it_runs_from():
    """memsem_bench lives in src/memsem_bench/: the files it runs from the checkout are there
    (the pipeline table's benchmarks/bench_pipeline.py, the fan-out's namespaces)."""
    from memsem_bench import CHECKOUT

    assert (CHECKOUT / "benchmarks" / "bench_pipeline.py").is_file()
    assert (CHECKOUT / "tests" / "netns" / "netns.py").is_file()


def test_reshard_bench_model_and_plan_figure():
    """``memsem bench --reshard``'s pure parts (its 8-process run is the bench's own): the model
    is Llama-shaped and at least the size asked for; the 1,000-tensor plan is what it says."""
    import math

    from memsem_bench import reshard

    shapes = reshard.model_shapes(256)
    assert sum(math.prod(s) for s in shapes.values()) * 2 >= 256 << 20
    assert "layers.0.self_attn.q_proj.weight" in shapes and "layers.0.mlp.down_proj.weight" in shapes
    ms, runs = reshard.plan_ms_1000_tensors(repeat=1)
    # 111 layers of hidden 1024 over 4 ranks, read by TP rank 1 of 2: the column slices of
    # o_proj and down_proj are one run per row (1024 each, every trainer rank's rows apart)
    assert ms > 0 and runs >= 111 * 2 * 1024
    assert set(reshard.GOALS) == {"reshard_bytes_moved_ratio", "reshard_vs_gather_broadcast",
                                  "reshard_vs_dtensor_redistribute", "reshard_plan_ms_1000_tensors",
                                  "reshard_trainer_blocked_ms", "reshard_delta_bytes_ratio_1pct",
                                  "reshard_delta_vs_full_1pct"}


def test_ray_transport_table_and_goals():
    """``memsem bench --ray``'s table: every size and way, ratios with their spread, each goal
    judged (a missing figure is skipped, never met), the notes; Ray itself runs in tests/ray."""
    from memsem_bench import ray_transport as RT

    fig = {"ray_store_256MiB_ms": 2000.0, "ray_memsem_256MiB_ms": 500.0, "ray_store_vs_memsem_256MiB": 4.0,
           "ray_store_vs_memsem_256MiB_spread": [3.5, 4.5], "ray_gloo_vs_memsem_256MiB": 1.2,
           "ray_gloo_vs_memsem_256MiB_spread": [1.0, 1.4], "ray_memsem_cross_node_ok": True,
           "ray_notes": ["gloo: none"]}
    out = RT.table(fig)
    assert set(RT.SIZES) == {"64KiB", "4MiB", "256MiB"} and RT.RECEIVERS == 4
    assert "4.00 [3.50, 4.50]" in out and "2000.000" in out
    assert "ray_store_vs_memsem_256MiB >= 2.0: 4.0 (met)" in out
    assert "ray_gloo_vs_memsem_256MiB >= 1.5: 1.2 (not met)" in out
    assert "ray_store_vs_memsem_64KiB >= 1.5: - (skipped)" in out
    assert "ray_memsem_cross_node_ok: True" in out and "note: gloo: none" in out
    assert "ray_store_vs_null_64KiB" not in out  # no null figure: no verdict
    # the null transport (no byte moved) is Ray's floor: a ratio below the goal says no
    # transport can meet it; at or above, that it is within reach
    fig.update({"ray_null_64KiB_ms": 8.0, "ray_store_vs_null_64KiB": 0.7, "ray_store_vs_null_64KiB_spread": [0.6, 0.9]})
    out = RT.table(fig)
    assert "8.000" in out and "0.70 [0.60, 0.90]" in out
    assert "ray_store_vs_null_64KiB: 0.7 (the best any tensor transport can do; below the goal: " \
           "no tensor transport can meet it in this run)" in out
    fig["ray_store_vs_null_64KiB"] = 1.6
    assert "the goal is within a transport's reach" in RT.table(fig)


def test_the_delta_bench_is_wired_and_names_the_issues_keys(monkeypatch):
    """``memsem bench --delta`` runs memsem_bench.delta (issue 36) and judges the issue's keys."""
    from memsem import cli
    from memsem_bench import delta as D

    seen = []
    monkeypatch.setattr(D, "run_delta", lambda args: seen.append((args.delta, args.json)) or 0)
    assert cli.main(["bench", "--delta", "--json"]) == 0 and seen == [(True, True)]
    assert set(D.GOALS) == {"delta_bytes_ratio_1pct", "delta_vs_full_1pct", "delta_vs_full_100pct",
                            "delta_adamw_bytes_ratio", "delta_trainer_blocked_ms"}
    assert D.GOALS["delta_bytes_ratio_1pct"][1](0.05) and not D.GOALS["delta_bytes_ratio_1pct"][1](0.06)
    assert D.GOALS["delta_adamw_bytes_ratio"][1] is None  # reported, with the measured changed fraction
    assert sum(n for _, n in D._shapes(256)) * 2 == 256 << 20  # the state dict is the issue's 256 MiB


def test_workload_runs_kills_and_recovers():
    """The workload table at its smallest (16 MiB, 2 rollouts, 3 steps): every key is there,
    the killed rollout's death reached the trainer as an error naming its process, and the
    restarted rollout holds the last version. No timing is judged here (the bench does)."""
    from memsem_bench import workload as W

    fig = W.figures(tiny=True)
    for key, _text, _ok in W.WORKLOAD_GOALS:
        assert fig[key] is not None, key
    for key in ("workload_vs_ideal_with_recovery", "workload_recovery_bound_s", "workload_death_to_error_s",
                "workload_bounce_bytes", "workload_first_tile_ms_p50", "workload_overlap_ratio",
                "workload_version_load_ms_p50", "workload_version_load_ms_p99", "workload_version_load_ms_p999",
                "workload_field_wait_ms_p50", "workload_field_wait_ms_p99", "workload_field_wait_ms_p999"):
        assert key in fig and fig[key] is not None, key
    assert fig["workload_error_names_rollout"] is True, fig["workload_error"]
    assert fig["workload_restarted_holds_current"] is True
    assert fig["workload_held_version"] == 1 + fig["workload_steps"]
    assert fig["workload_recovered_version"] == 1 + fig["workload_kill_step"]
    assert fig["workload_bounce_bytes"] == 0
    assert set(fig["workload_goals"].values()) <= {"met", "not met"}
