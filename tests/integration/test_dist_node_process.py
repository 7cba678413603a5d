"""`python -m services.dist.node` as a process against a real rank 0 store: it starts its host's
rank once the leader starts the group, stops it on SIGTERM (and tells rank 0), and exits non-zero,
taking its rank along, when the leader is killed (so LWS would recreate the group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from services.dist.nodes import START_KEY, Layout, NodeWatch, exit_key, master_store, pids_key, publish_layout
from tests.fleet_helpers import free_port, gone, start_dist_node

# Real processes, but no fleet and no time bound: it runs beside the unit tests (make test-unit).
pytestmark = pytest.mark.shares_host

LEADER = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    from services.dist.nodes import START_KEY, Layout, NodeWatch, master_store, publish_layout
    lay = Layout(world=2, nodes=2, local=1, store_port=int(sys.argv[1]), join_timeout_s=120)
    store = master_store("", lay.store_port, timedelta(seconds=60))
    publish_layout(store, lay, "actor", "gloo", 120.0)
    NodeWatch(store, lay).wait_joined("actor")
    store.set(START_KEY, "1")
    print(store.get("node/1/pids").decode(), flush=True)  # waits until the node started its rank
    time.sleep(600)
""")


def test_a_node_started_before_its_leader_exits_non_zero_with_its_rank_when_the_leader_dies(tmp_path: Path) -> None:
    port = free_port()
    # First: it retries until rank 0 listens.
    node = start_dist_node(port, tmp_path / "node.log", connect_timeout_s=120)
    time.sleep(1.0)
    leader = subprocess.Popen([sys.executable, "-c", LEADER, str(port)], stdout=subprocess.PIPE,
                              env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    try:
        assert leader.stdout is not None
        rank = int(leader.stdout.readline().decode().strip("[]\n"))
        assert node.poll() is None and not gone(rank, within_s=0.5), "the node runs its rank"
        leader.kill()
        assert node.wait(timeout=60) != 0, "a node outlived its leader"
        assert gone(rank), "the node's rank outlived the leader (an orphan)"
    finally:
        for p in (node, leader):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_sigterm_stops_the_nodes_rank_and_tells_rank_0(tmp_path: Path) -> None:
    lay = Layout(world=2, nodes=2, local=1, store_port=0, join_timeout_s=120, node_timeout_s=30)
    store = master_store("127.0.0.1", 0, timedelta(seconds=60))
    publish_layout(store, lay, "actor", "gloo", 120.0)
    node = start_dist_node(store.port, tmp_path / "node.log", connect_timeout_s=120)
    try:
        watch = NodeWatch(store, lay)
        watch.wait_joined("actor")
        store.set(START_KEY, "1")
        rank = int(store.get(pids_key(1)).decode().strip("[]"))
        assert watch.dead() == []
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0
        assert gone(rank), "SIGTERM left the node's rank running"
        assert watch.dead() == [1] and "stopped by a signal" in store.get(exit_key(1)).decode()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
