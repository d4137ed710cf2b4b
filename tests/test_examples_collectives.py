"""The collectives examples run on worlds of 2 and 3 and match their single-process references."""

import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name, *args):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    module = __import__(name)
    return module.main(*args)


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("name", ["global_batchnorm", "softmax_over_batch"])
def test_collective_examples(worlds, P, name):
    assert worlds(P).run(run_example, name) == [True] * P


@pytest.mark.parametrize("P", [4, 3])
def test_sharded_linear(worlds, P):
    """The motivating example, all four parts (the last one a shard_map): its 64 features divide by 4 and not by 3."""
    assert worlds(P).run(run_example, "sharded_linear") == [True] * P
