"""The code lines of each example of jax's shard_map tutorial and of its port (``test_shard_parity.py``): the port
is line for line, and this table says so (blank lines, comments and docstrings left out)."""

import ast
import inspect
import textwrap

import test_shard_parity as parity  # skipped with it where jax is not installed

# example: (code lines of jax_<example>, of cm_<example>), blank lines, comments and docstrings left out
LINES = {
    "matmul_basic": (9, 9),
    "specs_f1": (7, 7),
    "specs_f2": (7, 7),
    "specs_f3": (6, 6),
    "specs_f4": (6, 6),
    "specs_f5": (6, 6),
    "specs_untile": (6, 6),
    "psum_f1": (7, 7),
    "psum_f2": (7, 7),
    "psum_f3": (7, 7),
    "all_gather_f4": (7, 7),
    "all_gather_f5": (7, 7),
    "psum_scatter_f6": (7, 7),
    "ppermute_f7": (8, 8),
    "ppermute_psum_scatter_f8": (17, 17),
    "all_to_all_f9": (7, 7),
    "matmul_allgather": (9, 9),
    "matmul_allgather_overlapped": (17, 17),
    "matmul_allgather_overlapped_bidi": (26, 26),
    "matmul_psumscatter": (9, 9),
    "matmul_psumscatter_overlapped": (16, 16),
    "matmul_psumscatter_overlapped_bidi": (21, 21),
    "predict, loss (the model)": (9, 9),
    "dp": (9, 9),
    "fsdp": (17, 17),
    "tp": (20, 20),
    "fsdp_tp": (18, 18),
    "pp": (48, 48),
    "the port's helpers": (0, 15),  # make_mesh, set_at, add_at, remat
}


def code_lines(*fns):
    """Lines of the functions' sources that hold code: blank lines, comment lines and docstrings left out."""
    total = 0
    for fn in fns:
        source = textwrap.dedent(inspect.getsource(fn))
        defs = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
        docs = [
            d.body[0] for d in defs if isinstance(d.body[0], ast.Expr) and isinstance(d.body[0].value, ast.Constant)
        ]
        skip = {k for doc in docs for k in range(doc.lineno, doc.end_lineno + 1)}
        lines = enumerate(source.splitlines(), 1)
        total += sum(1 for k, line in lines if k not in skip and line.strip() and not line.strip().startswith("#"))
    return total


def test_line_table():
    """``LINES`` is what the examples' sources count."""
    counted = {
        "predict, loss (the model)": (
            code_lines(parity.jax_predict, parity.jax_loss),
            code_lines(parity.cm_predict, parity.cm_loss),
        ),
        "the port's helpers": (0, code_lines(parity.make_mesh, parity.set_at, parity.add_at, parity.remat)),
    }
    for name in LINES:
        if name not in counted:
            counted[name] = (code_lines(getattr(parity, "jax_" + name)), code_lines(getattr(parity, "cm_" + name)))
    assert counted == LINES
