"""The ``python`` code blocks of ``docs/`` run on real gloo worlds, so the documentation stays true to the code.

In each document the first ``python`` block is the setup; every later ``python`` block runs on every rank in a fresh
namespace after it and checks its own claims with ``assert``. Blocks fenced as ``py`` are illustrations and are not
run (they need a launcher, more processes, or a failure that would disturb the shared world).
"""

import re
from pathlib import Path
from typing import List, Tuple

import pytest

DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
DOCS = ["api.md", "guide.md", "collectives.md", "shard_map.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(name: str) -> List[Tuple[int, str]]:
    """(first line number, code) of each ``python`` block of ``docs/<name>``."""
    text = (DOCS_DIR / name).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def _compile(name: str, line: int, code: str):
    # Pad with blank lines so tracebacks point at the line in the document.
    return compile("\n" * (line - 1) + code, f"docs/{name}", "exec")


def run_doc(name: str) -> int:
    """Runs in every worker: the setup block, then each later block in its own namespace. Returns the count run."""
    (setup_line, setup), *blocks = python_blocks(name)
    for line, code in blocks:
        namespace = {"__name__": f"docs_{Path(name).stem}"}
        exec(_compile(name, setup_line, setup), namespace)
        exec(_compile(name, line, code), namespace)
    return len(blocks)


@pytest.mark.parametrize("name", DOCS)
def test_docs_have_examples(name):
    assert len(python_blocks(name)) >= 2


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("name", DOCS)
def test_doc_examples_run(worlds, P, name):
    count = len(python_blocks(name)) - 1
    assert worlds(P).run(run_doc, name) == [count] * P
