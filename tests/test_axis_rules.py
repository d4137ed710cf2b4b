"""The collectives' rule table, and each rule's behaviour through the public ops.

The table (``colossalai_cmap.axis.collectives.RULES``) holds one record per collective: the structural checks say it
covers every public collective and that each transpose is an op of the table. The behaviour checks run each
collective once per rule in every place a rule decides the result, against torch's own computation on the whole
batch (``axis_cases``): the eager exchange (vmap and batched modes), the value every example holds alike (no
exchange), the batching rule at another vmap level (an outer ``torch.vmap``, a ``torch.vmap`` and a nested cmap inside
func), the transpose (backward, double backward, ``torch.func.grad`` inside func) and the forward-mode rule (``jvp``
inside func). Float64, so cases.F64's tolerance holds (see test_axis_ops).
"""

import pytest
import torch
import torch.distributed as dist
from axis_cases import BY_NAME, Case
from cases import F64, randn

import colossalai_cmap as cm
from colossalai_cmap.axis import collectives
from colossalai_cmap.axis.collectives import RULES

DOUBLE = torch.float64
# one case per rule: the op with the argument its rule lowers natively over one axis name
PER_RULE = {
    "psum": "psum",
    "pmax": "pmax",
    "pmin": "pmin",
    "all_gather": "all_gather",
    "psum_scatter": "psum_scatter dim=1",
    "all_to_all": "all_to_all 0,1",
    "ppermute": "ppermute partial",
    "psum_grouped": "psum grouped",
    "all_gather_grouped": "all_gather grouped",
    "psum_scatter_grouped": "all_gather grouped",  # the grouped gather's transpose: its backward runs it
    "pmax_grouped": "pmax grouped",
    "pmin_grouped": "pmin grouped",
}
# the public names that are no collective of their own: a psum over the size, the axis's size and index, and the
# varying-axis casts and their compositions (pcast/pvary move nothing; all_gather_invariant is a gather, pbroadcast a
# masked psum)
COMPOSED = {"pmean", "axis_index", "axis_size", "pcast", "pvary", "all_gather_invariant", "pbroadcast"}
# the rules of axis_index_groups= (psum's, pmax's, pmin's and all_gather's, and the grouped gather's transpose)
GROUPED = {"psum_grouped", "pmax_grouped", "pmin_grouped", "all_gather_grouped", "psum_scatter_grouped"}


def test_the_table_covers_every_public_collective():
    assert set(RULES) - GROUPED == set(collectives.__all__) - COMPOSED
    assert set(PER_RULE) == set(RULES)
    assert all(rule.name == name for name, rule in RULES.items())


def test_each_transpose_is_an_op_of_the_table():
    differentiable = {name for name, rule in RULES.items() if rule.transpose is not None}
    assert differentiable == set(RULES) - {"pmax", "pmin", "pmax_grouped", "pmin_grouped"}
    for name in differentiable:
        back = RULES[name].transpose.op
        assert back in RULES, f"{name}'s transpose {back!r} is not in the table"
        # a linear op's transpose is transposed back to it: psum, all_to_all and ppermute to themselves,
        # all_gather and psum_scatter to each other (and so their grouped forms)
        assert RULES[back].transpose.op == name


def test_each_kind_has_its_result_shape():
    """A reduction and the gather give every example the same value; a per-example op gives each its own part."""
    kinds = {name: rule.kind.value for name, rule in RULES.items()}
    assert kinds == {
        "psum": "reduce",
        "pmax": "reduce",
        "pmin": "reduce",
        "all_gather": "gather",
        "psum_scatter": "per-example",
        "all_to_all": "per-example",
        "ppermute": "per-example",
        "psum_grouped": "per-example",  # each member gets its own group's result
        "all_gather_grouped": "per-example",
        "psum_scatter_grouped": "per-example",
        "pmax_grouped": "per-example",
        "pmin_grouped": "per-example",
    }


# ---------------------------------------------------------------------------------------------- the behaviour
def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **F64, msg=lambda m: f"{what}: {m}")


def _per_inner(case: Case, X: torch.Tensor) -> torch.Tensor:
    """The oracle for a collective over the cmap's axis applied to each index of an inner dim 1 of X."""
    return torch.stack([case.ref(X[:, k]) for k in range(X.shape[1])], 1)


def _values(case: Case, B: int, X: torch.Tensor, what: str) -> None:
    f, want = case.f(B), case.ref(X)
    for mode in ("vmap", "batched"):
        _close(cm.cmap(f, axis_name="i", mode=mode)(X), want, f"{what} {mode}")
    # an input every example holds alike: the rule's unbatched value, with no exchange
    same = X[0]
    got = cm.cmap(lambda v: f(v) + f(same), axis_name="i")(X)
    _close(got, want + case.ref(same.expand_as(X)), f"{what} unbatched input")
    # another vmap level than the axis's: outside the cmap, inside func, and a nested cmap inside func
    stacked = torch.stack([X, 2 * X + 1])
    got = torch.vmap(cm.cmap(f, axis_name="i"))(stacked)
    _close(got, torch.stack([case.ref(s) for s in stacked]), f"{what} under an outer torch.vmap")
    inner = torch.stack([X, X.cos()], 1)  # (B, 2, *shape)
    _close(cm.cmap(torch.vmap(f), axis_name="i")(inner), _per_inner(case, inner), f"{what} torch.vmap in func")
    _close(cm.cmap(cm.cmap(f), axis_name="i")(inner), _per_inner(case, inner), f"{what} cmap nested in func")


def _gradients(case: Case, B: int, X: torch.Tensor, what: str) -> None:
    f, W = case.f(B), randn(*case.ref(X).shape, seed=B, dtype=DOUBLE)
    V = randn(*X.shape, seed=B + 1, dtype=DOUBLE)

    def first_and_second(fn):
        x = X.clone().requires_grad_()
        (g,) = torch.autograd.grad((fn(x).sin() * W).sum(), x, create_graph=True)
        return g, torch.autograd.grad((g * V).sum(), x)[0]

    want = first_and_second(case.ref)
    got = first_and_second(cm.cmap(f, axis_name="i"))
    _close(got[0], want[0], f"{what} backward")
    _close(got[1], want[1], f"{what} double backward")
    got = cm.cmap(lambda v, w: torch.func.grad(lambda u: (f(u).sin() * w).sum())(v), axis_name="i")(X, W)
    _close(got, torch.func.grad(lambda x: (case.ref(x).sin() * W).sum())(X), f"{what} torch.func.grad in func")
    got = cm.cmap(lambda v, t: torch.func.jvp(f, (v,), (t,))[1], axis_name="i")(X, V)
    _close(got, torch.func.jvp(case.ref, (X,), (V,))[1], f"{what} jvp in func")


def _refused(case: Case, B: int, X: torch.Tensor, what: str) -> None:
    """No transpose: forward mode says the op is not differentiable, and so does backward across ranks, on every rank
    together, a rank with no rows too (in a group of one the local max's own gradient flows)."""
    f = case.f(B)
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = X.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="not differentiable"):
            cm.cmap(f, axis_name="i")(x).sum().backward()
    with pytest.raises((cm.CmapError, RuntimeError), match="not differentiable"):
        cm.cmap(lambda v: torch.func.jvp(f, (v,), (torch.ones_like(v),))[1], axis_name="i")(X)


def check_rules(sizes):
    done = 0
    for B in sizes:
        for k, (op, name) in enumerate(PER_RULE.items()):
            case = BY_NAME[name]
            X = randn(B, *case.shape(B), seed=17 * B + k, dtype=DOUBLE)
            what = f"{op} B={B}"
            _values(case, B, X, what)
            (_gradients if RULES[op].transpose is not None else _refused)(case, B, X, what)
            done += 1
    return done


@pytest.mark.parametrize("P", [1, 2, 3])
def test_each_rule_against_torch(worlds, P):
    sizes = [3] if P < 3 else [2]  # uneven shares (P=2), and a rank holding none (P=3)
    counts = worlds(P).run(check_rules, sizes, deadline=180)
    assert counts == [len(PER_RULE) * len(sizes)] * P
