"""Session-wide pools of gloo worlds (one per size), shared by every distributed test in this pytest process."""

from typing import Callable, Dict, Iterator, List, Optional

import pytest
from harness import World

_POOLS: List[Dict[int, World]] = []  # every pool of this pytest process


def _pool(env: Optional[Dict[str, str]] = None) -> Iterator[Callable[[int], World]]:
    pool: Dict[int, World] = {}
    _POOLS.append(pool)

    def get(size: int) -> World:
        world = pool.get(size)
        if world is None or not world.alive:
            world = pool[size] = World(size, env=env)
        return world

    yield get
    _POOLS.remove(pool)
    for world in pool.values():
        world.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """After a test that failed, every pooled world is ended, so the next test starts on fresh ones: a check whose
    assertion failed in this process (its ranks returned) may have left a group broken, or a mesh cached on the ranks
    over one, which would fail the tests after it too."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for pool in _POOLS:
            for world in pool.values():
                world.kill()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[[int], World]]:
    yield from _pool()


@pytest.fixture(scope="session")
def host_worlds() -> Iterator[Callable[[int], World]]:
    """Worlds whose status rounds take a host group on CPU too (``COLOSSALAI_CMAP_STATUS_PLANE=host``): the layout
    every group takes on GPUs, where data moves over nccl and rounds over a gloo group on the same ranks."""
    yield from _pool({"COLOSSALAI_CMAP_STATUS_PLANE": "host"})
