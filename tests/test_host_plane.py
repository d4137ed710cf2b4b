"""The layout GPUs take, run on CPU: status rounds over a host gloo group, data over the data's own group.

On an accelerator every round goes over a gloo group on the same ranks, in host memory, and nothing of the data
rides in it, so no round reads device memory (``CallStats.host_reads`` stays 0). ``COLOSSALAI_CMAP_STATUS_PLANE=host``
(the ``host_worlds`` fixture) gives CPU groups the same layout, so that the suite runs it here: the core matrix, the
collectives, faults at every phase, shard_map and shard_model, all against the same oracles as the default layout.
"""

import time
from datetime import timedelta
from typing import Any, Dict, Tuple

import pytest
import shard_cases as sc
import test_collectives
import test_core
import test_faults
import test_tp_plan
import torch
import torch.distributed as dist
from torch import nn
from wire_tap import counting

import colossalai_cmap as cm

DEADLINE = 240


# ------------------------------------------------------------------------------------------------ host reads
def _steady(fn) -> Any:
    """``fn`` twice (the first call sizes the rounds and plans), the second one's log."""
    fn()
    with cm.record_collectives() as log:
        fn()
    return log


def workloads() -> Dict[str, Any]:
    """Steady-state calls of every kind, each a function of no arguments that runs forward and backward."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, 3, generator=g, requires_grad=True)
    big = torch.randn(8, 4000, generator=g, requires_grad=True)
    ops = {
        "psum": lambda v: cm.psum(v, "i") * v,
        "all_gather": lambda v: cm.all_gather(v, "i").sum(0) * v,
        "psum_scatter": lambda v: cm.psum_scatter(v.expand(8, 3), "i").sum(0) * v,
        "all_to_all": lambda v: cm.all_to_all(v.expand(8, 3), "i", 0, 0).sum(0) * v,
        "ppermute": lambda v: cm.ppermute(v, "i", [(i, (i + 1) % 8) for i in range(8)]) * v,
    }
    found = {
        "sin": lambda: cm.cmap(torch.sin)(x).sum().backward(),
        "sin, 128 KiB out": lambda: cm.cmap(torch.sin)(big).sum().backward(),
        "dst=local": lambda: cm.cmap(torch.sin, dst="local")(x).sum().backward(),
        "src=local": lambda: cm.cmap(torch.sin, src="local")(x).sum().backward(),
        "src=0": lambda: cm.cmap(torch.sin, src=0)(x.detach()),
    }
    for name, f in ops.items():
        found[name] = lambda f=f: cm.cmap(f, axis_name="i")(x).sum().backward()
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("i",))
    blocks = torch.randn(2 * dist.get_world_size(), 3, generator=g, requires_grad=True)  # equal blocks, as psum needs
    psum = cm.shard_map(lambda v: cm.psum(v, "i"), mesh, cm.P("i"), cm.P())
    found["shard_map psum"] = lambda: psum(blocks).sum().backward()
    mlp = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3))
    tp = cm.shard_model(mlp, plan={"0": "colwise", "2": "rowwise"})
    found["shard_model"] = lambda: tp(x).sum().backward()
    return found


def check_host_reads() -> Dict[str, Tuple[int, int]]:
    """Each workload's (host reads, collectives) in steady state."""
    return {name: (log.host_reads, log.count) for name, log in ((n, _steady(fn)) for n, fn in workloads().items())}


def test_no_host_reads_of_the_data_side(host_worlds):
    for found in host_worlds(3).run(check_host_reads, deadline=DEADLINE):
        assert {name: reads for name, (reads, _) in found.items()} == dict.fromkeys(found, 0)


def test_the_count_sees_the_reads_of_the_default_layout(worlds):
    """On CPU by default a round's table sits in the data's own buffers, and every round reads it: counted, so the
    zero above is a measurement."""
    for found in worlds(2).run(check_host_reads, deadline=DEADLINE):
        assert all(reads >= 1 for name, (reads, _) in found.items() if name != "shard_model"), found
        assert found["shard_model"][0] == 0  # Megatron's f and g: no round at all


# ------------------------------------------------------------------------------------------------ where it goes
def check_planes() -> Dict[str, Any]:
    x = torch.randn(8, 3, requires_grad=True)
    f = cm.cmap(lambda v: cm.psum(v, "i") * v, axis_name="i")
    f(x).sum().backward()
    with counting() as log:
        f(x).sum().backward()
    seen = log.where
    world = dist.group.WORLD
    rounds = [g for name, g, dtype in seen if dtype == torch.uint8]
    data = [g for name, g, dtype in seen if dtype != torch.uint8]
    return {
        "rounds": len(rounds),
        "rounds on the world": sum(g is world for g in rounds),
        "rounds' groups are gloo": all(dist.get_backend(g) == "gloo" for g in rounds),
        "data": len(data),
        "data on the world": sum(g is world for g in data),
    }


def test_rounds_take_the_host_group_and_data_the_data_group(host_worlds, worlds):
    for found in host_worlds(2).run(check_planes, deadline=DEADLINE):
        # forward: a round before the psum, its all_reduce, the exit round, the data's all_gather; backward: the
        # gathered output's round (the cotangent's rows go back with no communication) and the psum's all_reduce
        assert found["rounds"] >= 3 and found["rounds on the world"] == 0 and found["rounds' groups are gloo"], found
        assert found["data"] >= 2 and found["data on the world"] == found["data"], found
    for found in worlds(2).run(check_planes, deadline=DEADLINE):
        # the default layout on CPU: rounds on the data's group, small data inline in them
        assert found["rounds on the world"] == found["rounds"] >= 3 and found["data"] == 0, found


# --------------------------------------------------------------------------------------------- a timeout
def check_a_missing_rank_then_a_new_group(skipper: int) -> Tuple[str, bool]:
    """``skipper`` skips a call on a fresh group: its peers' host round times out and names it. Then every rank makes
    a new group, whose own host group is a fresh start: a call on it works."""
    timeout = 3.0
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=4 * timeout))
    f = cm.cmap(torch.sin, group=group, timeout=timeout)
    x = torch.randn(5, 2)
    f(x)
    text = "skipped"
    if dist.get_rank() == skipper:
        time.sleep(timeout + 1)  # the peers give up meanwhile
    else:
        try:
            f(x)
        except cm.CmapError as err:
            text = str(err)
    fresh = dist.new_group([0, 1, 2])
    return text, torch.equal(cm.cmap(torch.sin, group=fresh)(x), x.sin())


def test_a_timeout_names_the_missing_rank_and_a_new_group_works(host_worlds):
    got = host_worlds(3).run(check_a_missing_rank_then_a_new_group, 2, deadline=120)
    assert got[2] == ("skipped", True)
    for text, fresh_works in got[:2]:
        assert "exit round" in text and "group rank 2 (global rank 2) did not arrive" in text, text
        assert fresh_works


# ----------------------------------------------------------------------- the suite's oracles, in this layout
def test_every_src_dst_combination(host_worlds):
    counts = host_worlds(3).run(test_core.check_placements, [0, 1, 4, 7], deadline=DEADLINE)
    assert all(c == 4 * 8 * 9 for c in counts)


def test_collectives_values_and_gradients(host_worlds):
    assert all(c > 0 for c in host_worlds(3).run(test_collectives.check_ops, [0, 1, 5, 8], deadline=DEADLINE))
    assert all(c > 0 for c in host_worlds(3).run(test_collectives.check_grads, [0, 1, 5, 8], deadline=DEADLINE))


def test_fault_at_every_phase_reaches_every_rank(host_worlds):
    counts = host_worlds(3).run(test_faults.check_fault_matrix, deadline=DEADLINE)
    assert counts == [len(test_faults.cases(3))] * 3


def test_shard_map_collectives_and_uneven_blocks(host_worlds):
    assert host_worlds(3).run(sc.check_collectives, (3,), ("i",), "i", deadline=DEADLINE) == [True] * 3
    assert host_worlds(4).run(sc.check_uneven_and_tuple_specs, deadline=DEADLINE) == [True] * 4


def test_shard_model_llama(host_worlds):
    got = host_worlds(2).run(test_tp_plan.check_llama, deadline=DEADLINE)
    assert len(set(got)) == 1


def test_a_steady_src_call_says_its_word_on_the_host_group(host_worlds):
    """With rounds on a host group, the source's word at a steady start is an 8-byte broadcast there (the data's
    group never carries it, so no rank reads it from device memory), then the scatter alone."""
    import test_collectives_per_call as per_call

    for seen in host_worlds(3).run(per_call.check_src_steady, deadline=DEADLINE):
        assert seen["exact"] == [True] * 7, seen["exact"]
        assert "group rank 0 (global rank 0) raised" in seen["error"], seen["error"]
        first, steady = seen["calls"][0], seen["calls"][1]
        assert first.count("broadcast") == 2 and first.count("scatter") == 1, first
        assert steady.count("broadcast") == 1 and steady.count("scatter") == 1, steady
        assert seen["calls"][2:4] == [steady, steady] and seen["calls"][5] == steady and seen["calls"][7] == steady
        assert seen["calls"][4] == ("broadcast",) + first, seen["calls"][4]  # changed: the word, then the first path


def test_a_steady_shard_map_exit_sends_its_data_with_its_round_on_the_host_group(host_worlds):
    """With rounds on a host group the exit's data takes its own gather on the data's group; a steady call issues
    it right behind the round, so the two are in flight together (on GPUs: the host round and the nccl gather)."""
    import test_collectives_per_call as per_call

    for seen in host_worlds(3).run(per_call.check_shard_map_steady_exit, 4, deadline=DEADLINE):
        per_call.assert_steady_exit(seen, per_call.TOGETHER)
        assert seen["events"][0] == per_call.ONE_ROUND * 2, seen["events"][0]  # the first: the round, then the data


def test_a_steady_training_step_sends_each_way_s_data_with_its_round(host_worlds):
    """With rounds on a host group, a steady training step's forward (the exit) and backward (the x-gradient's gather)
    each issue the data's gather on the data's group right behind the round on the host group: on GPUs the host
    round and the nccl gather are in flight together, neither waiting for the other."""
    import test_collectives_per_call as per_call

    for seen in per_call.run_cases(host_worlds, 2, [(8, 4), (255, 256)], train=True):
        assert seen.exact, f"B={seen.B}: x.grad is not vmap's"
        assert seen.forward.events == [per_call.TOGETHER] * per_call.COUNTED, seen.forward.events
        assert seen.backward.events == [per_call.TOGETHER] * per_call.COUNTED, seen.backward.events


def test_a_steady_training_step_sends_its_output_and_its_weight_gradient_with_their_rounds(host_worlds):
    """With rounds on a host group and a (256, 256) weight shared by every example at P = 3, a steady training step's
    forward issues the output's gather, and its backward the weight gradient's all_reduce, on the data's group right
    behind their rounds on the host group: each way's round and data in flight together, as on GPUs. (Where every
    early send had to take the one shape last agreed, the exit's gather held it and the sum waited for its round.)"""
    import test_collectives_per_call as per_call

    for fwd, bwd, _, _, diff in host_worlds(3).run(per_call.check_weight_gradient, 256, deadline=DEADLINE):
        assert diff <= 8 * 20 * torch.finfo(torch.float32).eps * 8, diff  # as on the default layout
        assert fwd.events == [per_call.TOGETHER] * per_call.COUNTED, fwd.events
        assert bwd.events == [per_call.SUM_BEHIND_ROUND] * per_call.COUNTED, bwd.events


@pytest.mark.parametrize("op", ["psum_scatter", "all_to_all", "ppermute"])
def test_a_data_op_inside_f_sends_its_collective_with_its_round(host_worlds, op):
    """With rounds on a host group, a ``psum_scatter``, ``all_to_all`` or ring ``ppermute`` inside ``f`` (data never
    rides in a host round) issues its native collective on the data's group right behind its round once the steps
    repeat, as does the exit's gather; in backward, the op's transpose and the input gradient's gather do the same
    (on GPUs: the host round and the nccl collective in flight together). Values and gradients are the unsharded
    function's."""
    import test_collectives_per_call as per_call

    for seen, _ in host_worlds(3).run(per_call.check_data_ops_inside_f, op, 4, True, deadline=DEADLINE):
        assert seen.grad_error <= 12 * torch.finfo(torch.float64).eps, seen.grad_error
        native = per_call.behind_round(per_call.NATIVE[op])
        assert seen.forward.events == [native + per_call.TOGETHER] * per_call.COUNTED, seen.forward.events
        transpose = per_call.TOGETHER if op == "psum_scatter" else native  # psum_scatter's: an all_gather
        assert seen.backward.events == [transpose + per_call.TOGETHER] * per_call.COUNTED, seen.backward.events


def test_tiles_assemble_from_one_gather_on_the_host_group(host_worlds):
    """With rounds on a host group, tiles of one shape come back from one gather on the data's group, right behind
    the whole mesh's round (2 collectives); uneven tiles fall back with the same values."""
    import test_collectives_per_call as per_call

    for seen in host_worlds(4).run(per_call.check_tiles_in_a_loop, deadline=DEADLINE):
        assert seen["exact"] == [True] * 7, seen
        assert [seen["counts"][k] for k in (1, 2, 6)] == [2] * 3, seen["counts"]
        assert "f failed on purpose" in seen["error"] and "group rank 3" in seen["error"], seen["error"]


def test_failures_in_a_loop_on_a_mesh_on_the_host_group(host_worlds):
    """The exit's axis rounds, in flight together on their host groups: a rank that raises before, between or after
    collectives over either axis is every rank's CmapError naming it, and the next training step is right."""
    for seen in host_worlds(4).run(sc.check_failures_in_a_loop_on_a_mesh, deadline=DEADLINE):
        assert seen[3::4] == ["ok"] * 4, seen
        assert all(
            f"group rank {k // 4} (global rank {k // 4}) raised ValueError" in t
            for k, t in enumerate(seen)
            if k % 4 != 3
        )


def test_a_failure_before_a_collective_over_part_of_a_mesh_is_prompt_on_the_host_group(host_worlds):
    """With rounds on a host group, the announcement of f's first collective over each axis, and the exit's rounds on
    the axes f took one on, reach a rank that raised before it, or before a psum over the whole mesh, at once."""
    import test_collectives_per_call as per_call

    timeout = 30.0
    for seen in host_worlds(4).run(per_call.check_collectives_on_an_axis, timeout, deadline=DEADLINE):
        assert seen["exact"] == [True] * sum(not s[3] for s in per_call.AXIS_STEPS), seen
        assert [label for label, _ in seen["errors"]] == [s[0] for s in per_call.AXIS_STEPS if s[3]], seen["errors"]
        assert all("f failed on purpose" in error for _, error in seen["errors"]), seen["errors"]
        assert max(seen["seconds"]) < timeout / 3, seen["seconds"]
