"""The tcp benchmark's plumbing (``memsem bench`` keys of issue 14): every key is printed, with
the link it was measured on; goal verdicts follow the figures. No timing is asserted."""
from __future__ import annotations

import os

import pytest

from memsem_bench import tcp as B


def test_bench_tcp_prints_every_key_and_the_link():
    fig, note = B.figures(quick=True)
    assert set(B.KEYS) <= set(fig), fig
    assert fig["tcp_link"] in ("veth", "loopback"), fig
    assert fig["tcp_link"] in note
    for k in ("tcp_get_64B_us", "socket_rtt_64B_us", "tcp_get_64MiB_GBps", "socket_64MiB_GBps",
              "remote_first_tile_ratio"):
        assert isinstance(fig[k], float) and fig[k] > 0, (k, fig, note)
    for k in ("tcp_owner_rss_MiB_1000_idle", "tcp_owner_rss_MiB_2000_unauth"):
        assert isinstance(fig[k], float), (k, fig, note)  # a growth: may be <= 0
    assert isinstance(fig["tcp_owner_threads_1000_idle"], int) and fig["tcp_owner_threads_1000_idle"] >= 1
    verdicts = B.goals_met(fig)
    assert set(verdicts) == set(B.GOALS) and all(isinstance(v, bool) for v in verdicts.values())
    # the placement the figures name is the one each process ran with (as it read its affinity)
    allowed = sorted(os.sched_getaffinity(0))
    one_cpu = [allowed[0]]
    assert fig["tcp_affinity_one_core"] == {"owner": one_cpu, "consumer": one_cpu}, fig
    assert isinstance(fig["tcp_get_64B_us_one_core"], float) and fig["tcp_get_64B_us_one_core"] > 0, fig
    assert isinstance(fig["tcp_get_64B_vs_socket_one_core"], float), fig
    if len(allowed) >= 2:
        assert fig["tcp_affinity"] == {"owner": [allowed[-1]], "consumer": one_cpu}, fig
        assert fig["tcp_placement"] == f"apart: owner CPU {allowed[-1]}, consumer CPU {allowed[0]}"
        assert fig["tcp_placement"] in note
    else:
        assert fig["tcp_placement"] == "unpinned", fig


def test_placement_names_its_cpus_and_refuses_others():
    allowed = sorted(os.sched_getaffinity(0))
    assert B.placement_cpus("shared") == (allowed[0], allowed[0])
    assert B.placement_cpus("none") is None
    assert B.placement_cpus("apart") == ((allowed[-1], allowed[0]) if len(allowed) >= 2 else None)
    with pytest.raises(ValueError, match="placement must be .* got 'together'"):
        B.placement_cpus("together")


def test_goal_verdicts():
    fig = {"tcp_get_64B_us": 13.0, "socket_rtt_64B_us": 10.0, "tcp_get_64MiB_GBps": 1.05,
           "socket_64MiB_GBps": 1.0, "remote_first_tile_ratio": 3.5,
           "tcp_owner_rss_MiB_1000_idle": 40.0}
    assert B.goals_met(fig) == {"tcp_get_64B_us": True, "tcp_get_64MiB_GBps": True,
                                "remote_first_tile_ratio": False, "tcp_owner_rss_MiB_1000_idle": False}
    assert B.goals_met({k: None for k in B.KEYS}) == {k: None for k in B.GOALS}
