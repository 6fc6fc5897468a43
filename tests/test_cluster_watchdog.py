"""The watchdog's timeout report names the node of ranks that did not arrive, and a node none of whose ranks answer.

The report is built without threads or MPI (test_guard's ``_reporter``), with host names given per rank; the
same report from a real link taken down between two network-namespace nodes is checked in tests/test_cluster.py.
"""

import io

import mpidist.guard.flight as flight
from test_guard import _Entry, _call, _reply, _reporter


def reporter(rank, hosts):
    dog = _reporter(rank, len(hosts))
    dog.hosts = list(hosts)
    dog.stream, dog.abort, dog.reply_wait = io.StringIO(), lambda: None, 0.0
    return dog


def test_missing_ranks_are_named_with_their_node():
    world = _Entry(range(4), "world")
    dog = reporter(0, ["node1", "node1", "node2", "node2"])
    lines = dog._arrivals(_call(world, 5, 12), {1: _reply(_call(world, 5, 12)), 3: _reply()})
    assert lines == ["  ranks that arrived: [0, 1]", "  ranks that did not: [2, 3] (on node2)"]
    lines = dog._arrivals(_call(world, 5, 12), {2: _reply(_call(world, 5, 12))})
    assert lines[1] == "  ranks that did not: [1, 3] (on node1: 1; node2: 3)"


def test_one_machine_reports_ranks_only():
    world = _Entry(range(2), "world")
    dog = reporter(0, ["vm", "vm"])
    assert dog._arrivals(_call(world, 0, 3), {}) == ["  ranks that arrived: [0]", "  ranks that did not: [1]"]
    assert dog._unreachable_nodes([1]) == []


def test_a_node_none_of_whose_ranks_answer_is_named_unreachable():
    hosts = ["node1", "node2", "node1", "node2", "node3", "node3"]  # round-robin over two nodes, then a third
    dog = reporter(0, hosts)
    assert dog._unreachable_nodes([1, 3]) == [
        "  node node2 unreachable: none of its ranks [1, 3] answered (the node or its network link is down)"]
    assert dog._unreachable_nodes([1]) == []       # rank 3 answered: node2 is reachable
    assert dog._unreachable_nodes([2]) == []       # this rank's own node is never unreachable
    assert len(dog._unreachable_nodes([1, 3, 4, 5])) == 2
    dog.departed = {3: (0.0, {})}                   # a rank that left normally is quiet too, not down
    assert dog._unreachable_nodes([1])[0].startswith("  node node2 unreachable")
    assert dog._unreachable_nodes([]) == []


def test_the_full_report_names_the_unreachable_node():
    world = _Entry(range(4), "world")
    dog = reporter(0, ["node1", "node1", "node2", "node2"])
    dog._ask = lambda ranks, dump_reason=None, wait=None, verdict=None: {1: _reply(_call(world, 7, 12))}
    rec = _call(world, 7, 12)
    dump, flight.dump = flight.dump, lambda reason: None
    try:
        dog._report("mpidist watchdog: allreduce #7 on world did not complete within 10 s", rec)
    finally:
        flight.dump = dump
    out = dog.stream.getvalue()
    assert "ranks that did not: [2, 3] (on node2)" in out, out
    assert "no answer from ranks [2, 3] (busy outside MPI, or dead) (on node2)" in out, out
    assert "node node2 unreachable: none of its ranks [2, 3] answered" in out, out
