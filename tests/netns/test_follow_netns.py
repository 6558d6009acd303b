"""A follower on another node keeps up with a trainer committing every step (issue 22): a trainer
in one network namespace commits a state dict back to back (and once per 20 ms step), a
follower (``Runtime.follow``) in the other loads it over the veth pair, every load pinned at the
owner. Outcomes are counted (every load completes and is bit-exact, none times out); the
rates are printed, never asserted (docs/many-nodes.md has the figures)."""
from __future__ import annotations

import pytest

from memsem_bench.follow import figures


@pytest.mark.netns
@pytest.mark.parametrize("step_ms", [0.0, 20.0])
def test_a_follower_across_namespaces_keeps_up_with_the_trainer(netns_available, step_ms):
    r = figures("veth", seconds=3.0, mib=4, step_ms=step_ms)
    print(f"\nfollow over veth, 4 MiB, step {step_ms:g} ms: {r['commits_per_s']:.1f} commits/s, "
          f"{r['loads_per_s']:.1f} loads/s, trainer blocked {r['blocked_s']:.2f} s of {r['seconds']:.1f} s, "
          f"{r['versions_skipped']} versions skipped")
    assert r["route"] == "tcp" and r["bad"] == 0
    assert r["loads"] >= 3 and r["commits"] >= r["loads"]
    assert r["recovered"] == 0  # no load was lost and made again


def test_a_follower_on_one_node_over_tcp_keeps_up():
    r = figures("loopback", seconds=3.0, mib=4)
    assert r["route"] == "tcp" and r["bad"] == 0 and r["loads"] >= 3 and r["commits"] >= r["loads"]
