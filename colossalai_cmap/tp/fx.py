"""``shard_linears_fx``: every Linear of a model sharded by a torch.fx rewrite onto cmap, with no plan.

A Linear ``y = x @ W.T + b`` with ``W`` of shape ``[out, in]`` is a sum over its input features. Sharded by input
features ("row" style), it is a cmap over the input-feature axis: each rank holds a slice of ``W``'s columns, takes
the same columns of ``x``, multiplies, and ``psum`` over the axis adds the partial products, a value every rank
shares (``out_dims=None``). Sharded by output features ("col" style), it is a cmap over the output-feature axis:
each rank computes its slice of ``y`` and cmap gathers the slices. Shards follow ``torch.tensor_split``, so the
feature counts need not divide by the group size, and nothing depends on the batch size.

The input ``x`` of every sharded layer must be the same on every rank (the model's input, and the replicated
activations between layers that both styles produce). Tensor parallelism from a plan, with activations left sharded
between layers, is :func:`~colossalai_cmap.tp.plan.shard_model`.
"""

import traceback
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.proxy import TraceError

from ..axis.collectives import axis_index, psum
from ..call.api import cmap
from ..integration.groups import resolve_group
from ..wire.group import Group

__all__ = ["shard_linears_fx", "ShardedLinear"]

STYLES = ("row", "col")
_CALL = "shard_linears_fx"
AXIS = f"{_CALL}.features"  # the mapped axis: input features ("row") or output features ("col")
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0]


def shard_linears_fx(
    model: nn.Module,
    group: Any = None,
    *,
    layers: Optional[Iterable[str]] = None,
    style: str = "row",
    check_inputs: bool = False,
) -> fx.GraphModule:
    """Shard a model's linear layers across a group by tracing it with ``torch.fx``, each layer a cmap.

    Every ``nn.Linear`` call and every ``F.linear`` call whose weight is a parameter (or only those named in
    ``layers``) is replaced by a :class:`ShardedLinear` that holds this rank's ``torch.tensor_split`` slice of the
    weight and runs the layer with ``cmap`` over the feature axis: a replicated input, a replicated output. The
    result equals the unsharded model's forward for any batch size, on every rank, and so do the gradients: a
    sharded weight's gradient is the matching slice of the unsharded one; the bias is added once.

    Every rank must call this with the same model (same architecture and weights, as after ``colossalai.launch``'s
    shared seed) and later pass the same inputs to the returned module.

    Args:
        model: the module to shard; it is not modified, and the returned module shares its unsharded parts.
        group: where the shards live, as for ``cmap``: None (the world, or this process alone when
            ``torch.distributed`` is not initialised), a ``ProcessGroup``, ``(ProcessGroupMesh, axis)``, or a
            colossalai ``Booster``/plugin.
        layers: names of the layers to shard: an ``nn.Linear`` by its module path (``"fc1"``), an ``F.linear``
            call by its weight's path (``"proj.weight"``). None: every one found.
        style: ``"row"`` splits the input features (partial products, then ``psum``); ``"col"`` splits the output
            features (then an all-gather).
        check_inputs: check on every forward, with cmap's input check, that every rank passed the same inputs; ranks
            that differ raise ``CmapError`` on every rank.

    Returns:
        A ``torch.fx.GraphModule`` whose sharded layers are :class:`ShardedLinear` submodules: an ``nn.Linear`` keeps
        its path; an ``F.linear`` call on weight ``p.w`` becomes submodule ``p.w_shard``.

    Raises:
        ValueError: an unknown ``style``, a name in ``layers`` that is not a shardable linear, or a sharded weight
            that the model also uses outside a linear call.
        torch.fx.proxy.TraceError: the model cannot be traced by ``torch.fx``; the message names the call.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 24))
        >>> sharded = shard_linears_fx(model)  # on every rank of the world
        >>> torch.testing.assert_close(sharded(x), model(x))
    """
    if style not in STYLES:
        raise ValueError(f"{_CALL}: unknown style={style!r}; expected one of {', '.join(map(repr, STYLES))}.")
    group_ = resolve_group(_CALL, group)
    gm = _trace(model)
    sites = _find_linears(gm)
    for name in _select(sites, layers):
        _check_only_linear(gm, name, sites[name])
        _rewrite(gm, name, sites[name], style, group_, check_inputs)
    gm.graph.lint()
    gm.recompile()
    return gm


class ShardedLinear(nn.Module):
    """This rank's shard of a Linear layer; ``forward`` runs the whole layer across the group with cmap.

    Args:
        weight: the full weight, ``[out_features, in_features]``; only this rank's slice is kept (a copy).
        bias: the full bias or None. "row" keeps all of it (added once, after the psum); "col" keeps its slice.
        style: "row" (split input features) or "col" (split output features).
        group: the resolved group the layer is sharded over.

    Attributes:
        weight: this rank's ``torch.tensor_split`` slice: columns (``"row"``) or rows (``"col"``) of the weight.
        bias: the full bias (``"row"``), this rank's slice of it (``"col"``), or None.
    """

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], style: str, group: Group, check_inputs: bool = False
    ) -> None:
        super().__init__()
        self.style = style
        self.out_features, self.in_features = weight.shape
        self.rank, self.world = group.rank, group.size
        self.weight = nn.Parameter(_slice(weight, 1 if style == "row" else 0, group), weight.requires_grad)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            kept = bias.detach().clone() if style == "row" else _slice(bias, 0, group)
            self.bias = nn.Parameter(kept, bias.requires_grad)
        options: Dict[str, Any] = dict(group=group.pg, src="local", mode="batched", check_inputs=check_inputs)
        if style == "row":
            self._layer = cmap(_row_partial, in_dims=(1, None), out_dims=None, axis_name=AXIS, **options)
        elif bias is None:
            self._layer = cmap(_col_slice, in_dims=(0, None), out_dims=-1, **options)
        else:
            self._layer = cmap(_col_slice_bias, in_dims=(0, 0, None), out_dims=-1, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, full_weight, full_bias)`` on every rank; ``x`` must be the same on every rank."""
        if self.style == "row":
            out = self._layer(self.weight, x)
            return out if self.bias is None else out + self.bias
        if self.bias is None:
            return self._layer(self.weight, x)
        return self._layer(self.weight, self.bias, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"style={self.style!r}, shard={tuple(self.weight.shape)} on rank {self.rank} of {self.world}"
        )


# ------------------------------------------------------------------------------------------ the mapped functions
def _row_partial(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched over this rank's input features: ``weight`` holds their columns, ``axis_index`` their global indices.

    The per-feature contributions ``x[..., f] * weight[:, f]`` are summed over the whole feature axis by ``psum``.
    Summing this rank's own features first (the local matmul) gives the same sum, so the partial product enters
    ``psum`` as a single row (batched-mode collectives reduce dim 0) instead of one ``[..., out]`` block per feature.
    """
    partial = F.linear(x.index_select(-1, axis_index(AXIS)), weight)
    return psum(partial.unsqueeze(0), AXIS)[0]


def _col_slice(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Batched over this rank's output features: its slice of the output, features last."""
    return F.linear(x, weight)


def _col_slice_bias(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _slice(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's ``torch.tensor_split`` slice, copied so that the full tensor can be freed."""
    return t.detach().tensor_split(group.size, dim=dim)[group.rank].clone()


# --------------------------------------------------------------------------------------------------- tracing
class _Tracer(fx.Tracer):
    """``fx.Tracer`` that remembers which submodule it was tracing when tracing failed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: List[str] = []

    def call_module(self, m: nn.Module, forward: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        self.stack.append(f"{self.path_of_module(m)!r} ({type(m).__name__})")
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # left in place when tracing raised, to name the module in the error
        return out


def _trace(model: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        raise TraceError(_untraceable_message(model, tracer, exc)) from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.train(model.training)
    return gm


def _untraceable_message(model: nn.Module, tracer: _Tracer, exc: BaseException) -> str:
    """Name the user code line (the innermost frame outside torch) where tracing failed, and its submodule."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at the call `{(f.line or '').strip()}` in {f.name}() ({f.filename}:{f.lineno})"
    inside = f" inside submodule {tracer.stack[-1]}" if tracer.stack else ""
    return (
        f"{_CALL}: torch.fx cannot trace {type(model).__name__}{inside}{where}: {type(exc).__name__}: {exc}. "
        f"{_CALL} needs a model that torch.fx can trace symbolically: move data-dependent control flow and "
        f"non-torch calls out of forward, wrap such a helper with torch.fx.wrap, or shard a traceable submodule "
        f"instead (model.block = {_CALL}(model.block))."
    )


# ------------------------------------------------------------------------------------------- finding linears
class _Site:
    """One shardable layer: an ``nn.Linear`` submodule, or the parameters of ``F.linear`` calls."""

    def __init__(self, module: bool, bias: Optional[str] = None) -> None:
        self.module = module
        self.bias = bias  # F.linear: the bias parameter's path, or None
        self.nodes: List[fx.Node] = []


def _find_linears(gm: fx.GraphModule) -> Dict[str, _Site]:
    sites: Dict[str, _Site] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear):
            sites.setdefault(node.target, _Site(True)).nodes.append(node)
        elif node.op == "call_function" and node.target is F.linear:
            weight, bias = _linear_arg(node, 1, "weight"), _linear_arg(node, 2, "bias")
            if not _is_attr(weight) or not (bias is None or _is_attr(bias)):
                continue  # a computed weight or bias: nothing to shard
            site = sites.setdefault(weight.target, _Site(False, bias.target if bias is not None else None))
            if site.bias != (bias.target if bias is not None else None):
                raise ValueError(
                    f"{_CALL}: weight {weight.target!r} is used by F.linear calls with different biases; "
                    f"exclude it with layers=[...]."
                )
            site.nodes.append(node)
    return sites


def _linear_arg(node: fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _is_attr(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and arg.op == "get_attr"


def _select(sites: Dict[str, _Site], layers: Optional[Iterable[str]]) -> List[str]:
    if layers is None:
        if not sites:
            warnings.warn(f"{_CALL}: the model has no nn.Linear or F.linear layer to shard.", stacklevel=3)
        return list(sites)
    names = [layers] if isinstance(layers, str) else list(layers)
    unknown = [n for n in names if n not in sites]
    if unknown:
        raise ValueError(
            f"{_CALL}: layers {unknown} are not shardable linear layers of the traced model; found: {list(sites)} "
            f"(nn.Linear by module path, F.linear by weight path)."
        )
    return list(dict.fromkeys(names))


def _check_only_linear(gm: fx.GraphModule, name: str, site: _Site) -> None:
    """A sharded weight must not be read elsewhere: those reads would see only this rank's slice."""
    if not site.module:  # its owner must not be a called (leaf) module too: that one would lose the weight
        owners = {path.rpartition(".")[0] for path in (name, site.bias) if path}
        called = owners & {node.target for node in gm.graph.nodes if node.op == "call_module"}
        if called:
            raise ValueError(
                f"{_CALL}: layer {name!r} cannot be sharded: it belongs to module {called.pop()!r}, which the model "
                f"also calls. Leave it out with layers=[...]."
            )
    prefix = f"{name}." if site.module else None
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owned = node.target.startswith(prefix) if prefix else node.target in (name, site.bias)
        others = [u for u in node.users if u not in site.nodes]
        if owned and (site.module or others):
            use = others[0] if others else node
            raise ValueError(
                f"{_CALL}: layer {name!r} cannot be sharded: its parameter {node.target!r} is also used outside the "
                f"linear call (by node {use.name!r}: {use.format_node()}). Leave it out with layers=[...]."
            )


# -------------------------------------------------------------------------------------------------- rewriting
def _rewrite(gm: fx.GraphModule, name: str, site: _Site, style: str, group: Group, check: bool) -> None:
    if site.module:
        linear = gm.get_submodule(name)
        _set_attr(gm, name, ShardedLinear(linear.weight, linear.bias, style, group, check))
        return  # the call_module nodes now call the sharded layer
    weight = _get_attr(gm, name)
    bias = _get_attr(gm, site.bias) if site.bias is not None else None
    target = _free_name(gm, f"{name}_shard")
    _set_attr(gm, target, ShardedLinear(weight, bias, style, group, check))
    for node in site.nodes:
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(target, (_linear_arg(node, 0, "input"),))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # drop the full parameters: they are now unused
        if node.op == "get_attr" and node.target in (name, site.bias) and not node.users:
            gm.graph.erase_node(node)
    for path in filter(None, (name, site.bias)):
        owner, _, attr = path.rpartition(".")
        delattr(gm.get_submodule(owner), attr)


def _get_attr(gm: fx.GraphModule, path: str) -> torch.Tensor:
    owner, _, attr = path.rpartition(".")
    return getattr(gm.get_submodule(owner), attr)


def _set_attr(gm: fx.GraphModule, path: str, value: nn.Module) -> None:
    owner, _, attr = path.rpartition(".")
    setattr(gm.get_submodule(owner), attr, value)


def _free_name(gm: fx.GraphModule, path: str) -> str:
    owner, _, attr = path.rpartition(".")
    parent, candidate, n = gm.get_submodule(owner), attr, 1
    while hasattr(parent, candidate):
        candidate, n = f"{attr}_{n}", n + 1
    return f"{owner}.{candidate}" if owner else candidate
