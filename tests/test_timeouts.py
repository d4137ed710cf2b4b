"""A wait that fails names who is missing: the ranks that never arrived, and the call, round and collective number
each was last in (wire/presence.py).

Every check runs on a fresh subgroup of one world of 3, made for this module and killed after it: a timeout marks the
group it happened on unusable, and leaves a collective of it half done.
"""

import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from harness import DIED, World
from torch import nn

import colossalai_cmap as cm
from colossalai_cmap.wire import presence

# Far above the publisher's tick (a stalled rank's record is in the store within two ticks), so that a loaded
# machine still publishes in time; small enough to keep the module fast.
TIMEOUT = 3.0
assert TIMEOUT >= 8 * presence.TICK


@pytest.fixture(scope="module")
def world():
    w = World(3)
    yield w
    w.kill()


def _group(ranks):
    """A fresh group for one check; gloo gives up its half-done collective soon after the check's timeout."""
    return dist.new_group(ranks, timeout=timedelta(seconds=4 * TIMEOUT))


def _waiting(text):
    """The number of the collective this rank waited in, from its error."""
    found = re.search(r"This rank was waiting in collective #(\d+) on this group", text)
    assert found, text
    return int(found.group(1))


def check_skipped_call(skipper):
    """``skipper`` makes the first calls on a fresh group, then skips one; its peers name it."""
    group = _group([0, 1, 2])
    f = cm.cmap(torch.sin, group=group, timeout=TIMEOUT)
    x = torch.randn(5, 2, requires_grad=True)
    with cm.record_collectives() as log:  # a few kinds of call, so that the counts must stay in step
        f(x).sum().backward()
        cm.cmap(torch.cos, dst=1, group=group, timeout=TIMEOUT)(torch.randn(7, 3))
        f(torch.randn(5000, 8))  # a data phase beyond the round's payload
    made = log.count
    if dist.get_rank() == skipper:
        time.sleep(TIMEOUT + 1)  # the peers give up meanwhile; then leave the broken group alone
        return made, "skipped"
    start = time.monotonic()
    with pytest.raises(cm.CmapError) as info:
        f(x)
    return made, str(info.value), time.monotonic() - start


def test_a_rank_that_skips_a_call_is_named(world):
    results = world.run(check_skipped_call, 2, deadline=120)
    assert results[2][1] == "skipped"
    made = results[2][0]
    for rank in (0, 1):
        assert results[rank][0] == made
        _, text, elapsed = results[rank]
        assert text.startswith("cmap(sin, in_dims=0): all_gather failed on group rank"), text
        assert "A peer rank may have died or not reached this cmap call." in text
        assert _waiting(text) == made + 1
        assert f"waiting in collective #{made + 1} on this group (cmap(sin, in_dims=0), exit round)." in text
        assert (
            f"group rank 2 (global rank 2) did not arrive; it was last in cmap(sin, in_dims=0) collective #{made}, "
            in text
        ), text
        assert f"group rank {1 - rank} (global rank {1 - rank}) did not arrive" not in text, text
        assert elapsed < TIMEOUT + presence.READ_TIMEOUT + 5, elapsed


def check_stall_inside_func(sleeper):
    """``sleeper`` stalls between two collectives inside func: its peers, in the second one, name it and the first."""
    group = _group([0, 1, 2])

    def f(x):
        y = cm.psum(x, "i")
        if dist.get_rank() == sleeper:
            time.sleep(2 * TIMEOUT)
        return cm.pmax(y, "i")

    g = cm.cmap(f, axis_name="i", mode="batched", group=group, timeout=TIMEOUT)
    try:
        g(torch.ones(6, 2))
    except cm.CmapError as err:
        return str(err)
    return "returned"


def test_a_rank_stalled_inside_func_is_named_with_its_collective(world):
    results = world.run(check_stall_inside_func, 1, deadline=120)
    for rank in (0, 2):
        text = results[rank]
        # The wait inside func failed; the call raises that error at once (no round runs on the group after it).
        assert "This rank was waiting in collective #2 on this group (cmap(f, in_dims=0), op round (pmax('i')))" in text
        assert (
            "group rank 1 (global rank 1) did not arrive; it was last in cmap(f, in_dims=0) collective #1, "
            "op round (psum('i'))," in text
        ), text
        assert text.endswith("No further cmap collective runs on this group: create a new group (or restart)."), text
    # The sleeper came back to a group its peers had given up on: its own wait failed too, and its error says so.
    assert "gave up waiting" in results[1], results[1]


def check_skipped_backward(skipper):
    group = _group([0, 1, 2])
    x = torch.randn(6, 3, requires_grad=True)
    y = cm.cmap(torch.sin, group=group, timeout=TIMEOUT)(x)
    if dist.get_rank() == skipper:
        time.sleep(TIMEOUT + 1)
        return "skipped"
    with pytest.raises(cm.CmapError) as info:
        y.sum().backward()
    return str(info.value)


def test_a_rank_that_skips_backward_is_named(world):
    results = world.run(check_skipped_backward, 0, deadline=120)
    for rank in (1, 2):
        text = results[rank]
        n = _waiting(text)
        assert "sync round (a backward collective))." in text, text
        assert (
            f"group rank 0 (global rank 0) did not arrive; it was last in cmap(sin, in_dims=0) collective #{n - 1}, "
            "exit round" in text
        ), text


def check_subgroup_first_call(absent_rank):
    """On a group of global ranks [1, 2], global rank 2 (group rank 1) never makes a call; its last call was on
    another group."""
    whole = _group([0, 1, 2])
    pair = _group([1, 2])
    cm.cmap(torch.sin, group=whole, timeout=TIMEOUT)(torch.ones(3, 2))
    if dist.get_rank() != 1:
        time.sleep(TIMEOUT + 1)
        return "away"
    with pytest.raises(cm.CmapError) as info:
        cm.cmap(torch.cos, group=pair, timeout=TIMEOUT)(torch.ones(4, 2))
    return str(info.value)


def test_a_missing_rank_of_a_subgroup_is_named_by_group_and_global_rank(world):
    text = world.run(check_subgroup_first_call, 2, deadline=120)[1]
    assert "failed on group rank 0 (global rank 1)" in text, text
    assert "This rank was waiting in collective #1 on this group (cmap(cos, in_dims=0), exit round)." in text, text
    assert (
        "group rank 1 (global rank 2) did not arrive; it made no cmap collective on this group; its latest was in "
        "cmap(sin, in_dims=0) collective #1, exit round, on the group of global ranks [0, 1, 2], " in text
    ), text
    assert "s before this error, which it finished." in text, text


def check_skipped_layer(skipper):
    """A tensor-parallel model: ``skipper`` runs its first layer and stops before the others; its peers, in the
    last layer's sum, name it and the first layer's collective."""
    group = _group([0, 1, 2])
    os.environ["COLOSSALAI_CMAP_TIMEOUT"] = str(TIMEOUT)  # shard_model's layers take the timeout from here
    try:
        plan = {"0": "colwise_gather", "1": "colwise", "2": "rowwise"}
        model = cm.shard_model(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)), group, plan=plan)
    finally:
        del os.environ["COLOSSALAI_CMAP_TIMEOUT"]
    x = torch.randn(5, 4)
    if dist.get_rank() == skipper:
        model[0](x)
        time.sleep(TIMEOUT + 1)
        return "skipped"
    with pytest.raises(cm.CmapError) as info:
        model(x)
    return str(info.value)


def test_a_rank_that_stops_between_layers_is_named(world):
    results = world.run(check_skipped_layer, 1, deadline=120)
    for rank in (0, 2):
        text = results[rank]
        # A rowwise layer's sum is one all-reduce with no round, as in Megatron.
        assert "This rank was waiting in collective #2 on this group (shard_model, all_reduce)." in text, text
        assert (
            "group rank 1 (global rank 1) did not arrive; it was last in shard_model collective #1, sync round "
            "(the gather of layer '0')" in text
        ), text


def check_store_host_dies(timeout):
    """Rank 0, which hosts the store, dies inside func: the others still raise, within the bound."""

    def f(x):
        if dist.get_rank() == 0:
            os._exit(3)
        return x + 1

    start = time.monotonic()
    try:
        cm.cmap(f, mode="batched", timeout=timeout)(torch.ones(6, 2))
    except cm.CmapError as err:
        return time.monotonic() - start, str(err)
    return time.monotonic() - start, "returned"


def test_the_error_is_bounded_when_the_store_dies_too():
    w = World(2)
    try:
        results = w.run(check_store_host_dies, 20.0, deadline=90, may_die=True)
    finally:
        w.kill()
    assert results[0] == DIED
    elapsed, text = results[1]
    assert "A peer rank may have died or not reached this cmap call." in text, text
    assert "This rank was waiting in collective #1 on this group (cmap(f, in_dims=0), exit round)." in text, text
    assert "records could not be read" in text or "group rank 0 (global rank 0) did not arrive" in text, text
    assert elapsed < 20.0, elapsed  # gloo sees the closed socket at once; the store read has its own bound


def check_store_host_hangs():
    """Rank 0, which hosts the store, stops (SIGSTOP) inside func: rank 1 times out, and the store, which answers
    nothing now, cannot hold its error back past the read's own bound. Rank 1 then kills rank 0."""
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())

    def f(x):
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        return x + 1

    start = time.monotonic()
    try:
        cm.cmap(f, mode="batched", timeout=TIMEOUT)(torch.ones(6, 2))
    except cm.CmapError as err:
        return time.monotonic() - start, str(err)
    finally:
        os.kill(pids[0], signal.SIGKILL)
    return time.monotonic() - start, "returned"


def test_the_error_is_bounded_when_the_store_hangs():
    w = World(2)
    try:
        results = w.run(check_store_host_hangs, deadline=90, may_die=True)
    finally:
        w.kill()
    assert results[0] == DIED
    elapsed, text = results[1]
    assert "This rank was waiting in collective #1 on this group (cmap(f, in_dims=0), exit round)." in text, text
    bound = presence.READ_TIMEOUT
    assert f"The peers' presence records could not be read (the store did not answer within {bound:g} s)." in text
    assert elapsed < TIMEOUT + bound + 5, elapsed


def test_without_a_store_the_error_says_so():
    """The error path never needs the store: without torch.distributed it says the records could not be read."""
    tr = presence.track("not a group", (0, 1))
    doing = presence.note_issued(tr, "cmap(f)", "exit round")
    text = presence.absent(tr, doing, 0, "RuntimeError: Operation timed out!")
    assert text.startswith(" This rank was waiting in collective #1 on this group (cmap(f), exit round).")
    assert "The peers' presence records could not be read" in text, text
