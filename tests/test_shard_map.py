"""shard_map in real gloo worlds: every collective over 1-D meshes of 2 to 4 ranks and over tuple axes of a 2x2
mesh, spec kinds (sharded, replicated, tuple, uneven, pytrees), global and local I/O, autograd and torch.func
around it, closures and a training loop, checkpoint inside f, nesting with cmap, torch.compile around it, failures
on one rank, and a property test over random shapes and specs. The
oracle is a single-process reference of the global function (shard_cases)."""

import pytest
import shard_cases as sc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_collective_on_a_line(worlds, P):
    assert worlds(P).run(sc.check_collectives, (P,), ("i",), "i") == [True] * P


@pytest.mark.parametrize("ax", ["x", "y", ("x", "y"), ("y", "x")], ids=str)
def test_every_collective_on_a_2x2_mesh(worlds, ax):
    assert worlds(4).run(sc.check_collectives, (2, 2), ("x", "y"), ax) == [True] * 4


def test_every_collective_over_tuple_axes_untyped(worlds):
    """check_vma=False: the untyped transposes over ("y", "x") (pcast and psum's), on the axes' one group."""
    assert worlds(4).run(sc.check_collectives, (2, 2), ("x", "y"), ("y", "x"), False) == [True] * 4


def test_every_collective_over_part_of_a_mesh(worlds):
    """A tuple of two of three mesh axes: its ops run on the group of the ranks that differ along those two."""
    assert worlds(4).run(sc.check_collectives, (2, 2, 1), ("x", "y", "z"), ("z", "x")) == [True] * 4


@pytest.mark.parametrize("kind", ["device", "pg"])
def test_matmul_basic(worlds, kind):
    assert worlds(4).run(sc.check_matmul_2d, kind) == [True] * 4


def test_uneven_tuple_2d_and_pytree_specs(worlds):
    assert worlds(4).run(sc.check_uneven_and_tuple_specs) == [True] * 4


def test_local_io(worlds):
    assert worlds(4).run(sc.check_local_io) == [True] * 4


def test_transforms_around(worlds):
    assert worlds(2).run(sc.check_transforms) == [True] * 2


def test_closures_and_training(worlds):
    assert worlds(4).run(sc.check_closures_and_training) == [True] * 4


def test_checkpoint_inside(worlds):
    assert worlds(4).run(sc.check_checkpoint_inside) == [True] * 4


def test_cmap_inside_shard_map(worlds):
    assert worlds(2).run(sc.check_cmap_inside) == [True] * 2


def test_shard_map_inside_cmap(worlds):
    assert worlds(4).run(sc.check_shard_map_inside_cmap) == [True] * 4


@pytest.mark.parametrize("where,rank,kind", [("before", 3, "ValueError"), ("between", 0, "KeyError")])
def test_failure_on_one_rank(worlds, where, rank, kind):
    got = worlds(4).run(sc.check_failure, where)
    for text in got:
        assert text.startswith(f"CmapError[{kind}]: shard_map(f) failed on 1 rank(s)"), text
        assert f"group rank {rank} (global rank {rank}) raised {kind}" in text, text


def test_failures_in_a_loop_on_a_mesh(worlds):
    """The exit's axis rounds go out together: a rank that raises before, between or after collectives over either
    axis is every rank's CmapError naming it, and the next training step is right."""
    for seen in worlds(4).run(sc.check_failures_in_a_loop_on_a_mesh):
        for k, text in enumerate(seen):
            rank, where = divmod(k, 4)
            if where == 3:
                assert text == "ok", (k, text)
            else:
                assert f"group rank {rank} (global rank {rank}) raised ValueError: boom" in text, (k, text)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_collectives_and_failures_on_a_mesh(worlds, seed):
    """Random sequences of psums over either axis of a 2 x 2 mesh or both, under random specs, with a random rank
    raising at a random point in some steps: every failing step is every rank's CmapError naming that rank, at once
    (well within the timeout), and every other step runs, forward and backward."""
    timeout = 30.0
    for seen in worlds(4).run(sc.check_random_collectives_and_failures, 40, seed, timeout):
        for ops, fail, spec, got, seconds in seen:
            assert got == ("ok" if fail is None else "CmapError"), (ops, fail, spec, got)
            assert seconds < timeout / 3, (ops, fail, spec, seconds)


@pytest.mark.parametrize("size", [2, 3])
def test_carried_outputs_fail_alike(worlds, size):
    for seen in worlds(size).run(sc.check_carried_outputs_fail_alike):
        assert set(seen) == {"raise", "one output"}, seen
        assert "group rank 1 (global rank 1) raised ValueError: boom on rank 1" in seen["raise"], seen["raise"]
        assert "f returned outputs of different structures" in seen["one output"], seen["one output"]


@pytest.mark.parametrize("case", list(sc.BLOCK_SHAPE_CASES))
def test_blocks_of_another_shape_fail_alike(worlds, case):
    """Blocks are assembled by rows along their split dims. A rank whose block is longer along a dim the spec does
    not split, whose tile does not line up with its neighbours', or whose copy of a block (along an axis the spec
    leaves out) is longer than the others', is the same CmapError on every rank, before any data moves (never a
    peer's bytes read as rows, nor a collective of mismatched sizes); the next call is right."""
    size = 4 if "2-D" in case else 2
    path = "[0]" if "beside others" in case else ""
    texts = set()
    for seen in worlds(size).run(sc.check_block_shapes_differ, case):
        assert seen["exact"] == [True] * 5, seen
        texts.add(seen["error"])
    (text,) = texts
    if "off the grid" in case:
        assert "do not tile one global value: along dim 1, split over {y}, group rank 1 (x=0, y=1) has 3" in text
        assert "group rank 3 (x=1, y=1) has 4" in text, text
    elif "copies" in case:
        assert "along dim 0, split over {x}, group rank 2 (x=1, y=0) has 3 and group rank 3 (x=1, y=1) has 4" in text
        assert text.startswith(f"the outputs of shard_map(f): the blocks of the output at out_specs{path} (P('x'))")
    else:
        assert "f returned outputs of different structures, dtypes or shapes" in text, text
        longer = sc.BLOCK_SHAPE_CASES[case][3][-1] + 1
        assert f"group rank {size - 1}: float32 (" in text and str(longer) in text, text


def test_spec_errors(worlds):
    for got in worlds(4).run(sc.check_spec_errors):
        assert "which has length 3, but args[0] has shape (4, 4), which has rank 2" in got["rank"], got["rank"]
        assert "refers to 'z', not an axis of the mesh" in got["axis"], got["axis"]
        assert "names mesh axis 'x' twice" in got["twice"], got["twice"]
        assert "must be a tree prefix of the positional arguments tuple" in got["prefix"], got["prefix"]
        assert all(v.split("|")[1] == "True" for v in got.values()), got  # CmapError that is also a ValueError


def test_check_rep(worlds):
    assert worlds(4).run(sc.check_rep, True) == ["ok (4, 2)"] * 4
    for text in worlds(4).run(sc.check_rep, False):
        assert (
            "out_specs is P('x') which implies that the corresponding output value is only varying across mesh " in text
        )
        assert "axes {x} and not {y}, but it was inferred to be possibly varying over {x, y}" in text, text


def test_mesh_over_part_of_the_world(worlds):
    assert worlds(4).run(sc.check_partial_mesh) == [[2.0, 4.0, 4.0, 8.0]] * 2 + [None] * 2


def test_compiled_around(worlds):
    assert worlds(2).run(sc.check_compiled_around) == [True] * 2


@st.composite
def shapes_and_specs(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    free = ["x", "y"]
    entries = []
    for _ in range(draw(st.integers(0, len(shape)))):
        choice = draw(st.sampled_from([None, "one", "both"]))
        if choice == "one" and free:
            entries.append(free.pop(draw(st.integers(0, len(free) - 1))))
        elif choice == "both" and len(free) == 2:
            entries.append(tuple(draw(st.permutations(free))))
            free = []
        else:
            entries.append(None)
    return shape, tuple(entries)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(shapes_and_specs())
def test_any_shape_and_spec(worlds, case):
    shape, entries = case
    assert worlds(4).run(sc.check_spec_property, shape, entries) == [True] * 4
