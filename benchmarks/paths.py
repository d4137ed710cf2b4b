"""Where the benchmarks read and write in this checkout, and the one way they import an example script."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"  # what ``python -m benchmarks.run`` writes
DOCS = ROOT / "docs"  # where ``performance.md`` and ``img/perf_*.png`` are rendered
TEMPLATE = Path(__file__).resolve().with_name("performance.md.tmpl")
EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name`` (as the tests and the examples themselves import it).

    The examples are scripts, not a package; this imports one from its file, once per process.
    """
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no example {name!r} in {EXAMPLES}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_support(name: str) -> ModuleType:
    """``tests/<name>.py``, a module of the tests' own support (the wire counter, a world's environment), which
    the benchmarks measure with too. The tests directory goes on ``sys.path``, which spawned ranks inherit."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(name)
