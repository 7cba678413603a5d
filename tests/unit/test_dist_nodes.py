"""The multi-host group's settings: rank 0's RLFLEET_DIST_* environment, the worker node's
arguments, and the join (a node that never comes is named; one that disagrees is refused), each
failing with one line that names what to change."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from services.core.config.run import RunConfig
from services.dist import node
from services.dist.nodes import (
    LAYOUT_KEY,
    DistConfigError,
    DistEnv,
    Layout,
    NodeWatch,
    beat_key,
    exit_key,
    joined_key,
    layout_for,
    master_store,
    publish_layout,
)
from tests.fleet_helpers import tiny_config


def _cfg(tmp_path: Path, **actor: int) -> RunConfig:
    # Only the layout is read: no model is loaded, so any path will do.
    return tiny_config(tmp_path, tmp_path / "model", services={"actor": {"grpc_port": 0, "http_port": 0, **actor}})


def test_no_environment_is_the_single_host_group_of_trainer_ranks(tmp_path: Path) -> None:
    lay = layout_for(_cfg(tmp_path, trainer_ranks=2), "actor", {})
    assert (lay.world, lay.nodes, lay.local, lay.multi_node) == (2, 1, 2, False)


def test_the_environment_defines_the_world_and_global_ranks_go_node_by_node(tmp_path: Path) -> None:
    env = {"RLFLEET_DIST_NODES": "2", "RLFLEET_DIST_GPUS_PER_NODE": "8", "RLFLEET_DIST_STORE_PORT": "29500"}
    lay = layout_for(_cfg(tmp_path), "actor", env)
    assert (lay.world, lay.nodes, lay.local, lay.store_port) == (16, 2, 8, 29500)
    assert lay.ranks_of(1) == list(range(8, 16))
    assert layout_for(_cfg(tmp_path, trainer_ranks=16), "actor", env).world == 16  # agreeing is fine


def test_a_trainer_ranks_that_disagrees_with_the_environment_is_one_line_naming_both(tmp_path: Path) -> None:
    env = {"RLFLEET_DIST_NODES": "2", "RLFLEET_DIST_GPUS_PER_NODE": "8"}
    with pytest.raises(DistConfigError) as e:
        layout_for(_cfg(tmp_path, trainer_ranks=4), "actor", env)
    msg = str(e.value)
    assert "\n" not in msg and "RLFLEET_DIST_NODES" in msg and "services.actor.trainer_ranks is 4" in msg


@pytest.mark.parametrize(("var", "value"), [("NODES", "0"), ("NODES", "two"), ("GPUS_PER_NODE", "1.5"),
                                            ("STORE_PORT", "70000"), ("NODE_TIMEOUT_S", "-1")])
def test_a_bad_variable_is_one_line_naming_it(var: str, value: str) -> None:
    with pytest.raises(DistConfigError) as e:
        DistEnv.from_environ({f"RLFLEET_DIST_{var}": value})
    assert str(e.value).startswith(f"RLFLEET_DIST_{var}={value!r}:") and "\n" not in str(e.value)


@pytest.mark.parametrize(("args", "says"), [
    (["--node-rank", "0"], "--node-rank 0: must be 1..1"),
    (["--node-rank", "2"], "--node-rank 2: must be 1..1"),
    (["--nodes", "1", "--node-rank", "1"], "--nodes 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0"),
    (["--store-port", "0"], "--store-port 0"),
    (["--leader", " "], "--leader is empty"),
    (["--node-rank", "x"], "invalid int value: 'x'"),
])
def test_a_bad_node_argument_exits_2_with_one_line(args: list[str], says: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--service": "actor", "--leader": "127.0.0.1", "--node-rank": "1", "--nodes": "2",
            "--gpus-per-node": "1"}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    assert node.main([x for kv in base.items() for x in kv], process=False) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "usage" not in err


def _leader(nodes: int = 2, local: int = 1, join_timeout_s: float = 1.0) -> tuple[object, Layout]:
    lay = Layout(world=nodes * local, nodes=nodes, local=local, store_port=0, join_timeout_s=join_timeout_s,
                 node_timeout_s=0.5)
    store = master_store("127.0.0.1", 0, timedelta(seconds=10))
    publish_layout(store, lay, "actor", "gloo", 30.0)
    return store, lay


def test_rank_0_names_the_node_ranks_that_never_joined() -> None:
    store, lay = _leader(nodes=3, join_timeout_s=0.5)
    store.set(joined_key(1), json.dumps({"host": "a", "pid": 1}))  # type: ignore[attr-defined]
    with pytest.raises(DistConfigError) as e:
        NodeWatch(store, lay).wait_joined("actor")  # type: ignore[arg-type]
    assert "node rank(s) [2] did not join" in str(e.value) and "RLFLEET_DIST_JOIN_TIMEOUT_S" in str(e.value)


def test_rank_0_counts_a_node_dead_on_its_exit_word_or_a_stopped_heartbeat() -> None:
    store, lay = _leader(nodes=3)
    for k in (1, 2):
        store.set(joined_key(k), "{}")  # type: ignore[attr-defined]
    watch = NodeWatch(store, lay)  # type: ignore[arg-type]
    watch.wait_joined("actor")
    store.add(beat_key(1), 1)  # type: ignore[attr-defined]
    store.add(beat_key(2), 1)  # type: ignore[attr-defined]
    assert watch.dead() == []
    store.set(exit_key(1), "rank(s) [1] on node 1 exited")  # type: ignore[attr-defined]
    assert watch.dead() == [1] and "exited" in watch.why[1]
    deadline = 5.0
    import time

    t0 = time.monotonic()
    while watch.dead() != [1, 2] and time.monotonic() - t0 < deadline:
        time.sleep(0.1)
    assert watch.dead() == [1, 2] and "no heartbeat" in watch.why[2]


def test_a_node_whose_arguments_disagree_with_rank_0_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    store, _ = _leader(nodes=2, local=8)
    port = store.port  # type: ignore[attr-defined]
    rc = node.main(["--service", "actor", "--leader", "127.0.0.1", "--store-port", str(port), "--node-rank", "1",
                    "--nodes", "2", "--gpus-per-node", "1"], process=False)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "disagrees with rank 0's group (actor, 2 nodes x 8 ranks)" in err and "\n" not in err
    assert json.loads(store.get(LAYOUT_KEY))["local"] == 8  # type: ignore[attr-defined]
    assert not store.check([joined_key(1)])  # type: ignore[attr-defined]


def test_a_second_node_with_the_same_index_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    store, _ = _leader(nodes=2)
    store.set(joined_key(1), json.dumps({"host": "other", "pid": 1}))  # type: ignore[attr-defined]
    rc = node.main(["--service", "actor", "--leader", "127.0.0.1", "--store-port", str(store.port),  # type: ignore[attr-defined]
                    "--node-rank", "1", "--nodes", "2", "--gpus-per-node", "1"], process=False)
    assert rc == 2 and "already joined" in capsys.readouterr().err


def test_a_node_gives_up_on_an_absent_leader_within_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    rc = node.main(["--service", "actor", "--leader", "127.0.0.1", "--store-port", str(port), "--node-rank", "1",
                    "--nodes", "2", "--gpus-per-node", "1", "--connect-timeout-s", "1.5"], process=False)
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "unreachable after 1.5 s" in err and "\n" not in err
