"""One cmap call, step by step (DESIGN.md §3): resolve the group, check and shard the inputs, run the shard,
exchange status, gather, unflatten.
"""

import contextlib
import zlib
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import autograd, comm, context, steady
from .comm import BATCH, EMPTY, FAILED, INPUT_SIG, LAYOUT_SIG, OK, ROWS, STATUS
from .errors import CmapError, RankFailure
from .execute import rng_scope, run_shard
from .gather import batched_empty_like, cut_rows, gather, gather_batched, is_batched, pack, share_replicated, unpack
from .groups import Group, group_device, resolve_group
from .layout import BATCHED, CONSTANT, REPLICATED, OutLayout, infer_layout, replicated_checksums
from .sharding import split_for, take_local
from .specs import FlatArgs, check_placement, flatten_args, flatten_out_dims, normalise_out_dim

Placement = Union[int, str, None]
_CACHE_SIZE = 64


class Cmapped:
    """The callable ``cmap(func, ...)`` returns. Holds the options and a small per-signature layout cache."""

    def __init__(
        self,
        func: Callable,
        in_dims: Any,
        out_dims: Any,
        group: Any,
        dst: Placement,
        src: Placement,
        randomness: str,
        chunk_size: Optional[int],
        mode: str,
        axis_name: Optional[str],
        timeout: Optional[float],
        check_inputs: bool,
        call: str,
    ) -> None:
        self.func = func
        self.in_dims = in_dims
        self.out_dims = out_dims
        self.group = group
        self.dst = dst
        self.src = src
        self.randomness = randomness
        self.chunk_size = chunk_size
        self.mode = mode
        self.axis_name = axis_name
        self.timeout = timeout if timeout is not None else comm.default_timeout()
        self.check_inputs = check_inputs
        self.call = call
        self._layouts: "OrderedDict[int, OutLayout]" = OrderedDict()
        self._round = comm.ROUND_PAYLOAD  # payload bytes of this cmap's next status round (same on every rank)
        # (sig, layout digest, cap, leaf, sizes, dtype, example shape) of the previous call when it was a steady
        # large single-output all-gather: the next call sends its data together with the status round.
        self._speculate: Optional[Tuple[Any, ...]] = None
        self._sigs: Dict[Any, List[Tuple[Any, int]]] = {}
        # Repeated calls with the same argument shapes reuse the checked plan of the last clean call.
        self._plans = steady.SteadyPlans()
        self._steady_ok = (
            src is None and dst != "local" and axis_name is None and not check_inputs and randomness == "error"
        )
        self._clean_call: Optional[Tuple[Any, ...]] = None
        self._vmapped: Optional[Callable] = None  # torch.vmap's wrapper, built once: it costs a few us per call

    # ------------------------------------------------------------------ entry
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.call
        group = resolve_group(call, self.group)
        check_placement(call, "dst", self.dst, group.size, (-1, "local"))
        check_placement(call, "src", self.src, group.size, (None, "local"))
        if group.pg is not None:
            comm.check_usable(group, call)
        if isinstance(self.src, int):
            return self._call_from_src(group, args, kwargs)
        key = None
        if self._steady_ok and group.pg is not None and not kwargs:
            leaves, spec = tree_flatten(args)
            key = steady.plan_key(leaves)
            plan = self._plans.get(key, group.pg, spec)
            if (
                plan is not None
                and not (torch.is_grad_enabled() and _grad_anchor(leaves, {}, self.func) is not None)
                and torch._C._functorch.maybe_current_level() is None
            ):
                return self._steady_run(group, FlatArgs(leaves, list(plan.dims), spec, plan.batch), plan)
        flat = flatten_args(self.func, args, self.in_dims, call)
        if group.pg is None:
            return self._single(flat, kwargs)
        self._clean_call = None
        out = self._distributed(group, flat, kwargs)
        if key is not None and self._clean_call is not None and flat.batch_size:
            self._keep_plan(key, group, flat)
        return out

    def _keep_plan(self, key: Tuple[Any, ...], group: Group, flat: FlatArgs) -> None:
        sig, layout, sizes, device = self._clean_call
        rank = group.rank
        plan = steady.SteadyPlan(
            group.pg,
            flat.spec,
            tuple(flat.dims),
            flat.batch_size,
            sig,
            tuple(sizes),
            sizes[rank],
            sum(sizes[:rank]),
            device,
            layout,
        )
        self._plans.put(key, plan)

    def _steady_run(self, group: Group, flat: FlatArgs, plan: steady.SteadyPlan) -> Any:
        """A repeated call (see ``steady``): run the shard, then the usual end of call from the status exchange."""
        res = _LocalResult()
        rows = plan.rows
        res.layout = plan.layout
        if rows:
            try:
                out = self._run_shard(flat, take_local(flat.leaves, flat.dims, plan.offset, rows), rows, {}, None)
                res.flat, spec = tree_flatten(out)
                if not plan.layout.matches(res.flat, spec):
                    res.layout = self._layout_of(res.flat, spec)
                res.has_data = True
            except Exception as exc:  # every rank learns of it in the status exchange
                res.layout = None
                res.failure = RankFailure.from_exception(exc, group.rank, group.global_rank)
                res.cause = exc
        spec = self._speculate
        if res.layout is plan.layout and plan.device.type == "cpu":
            buf = self._plans.buffers(plan, self._round)
            if spec is None and buf.fits:
                return self._steady_finish(group, res, plan, buf)
            if spec is not None and spec[:2] == (plan.sig, plan.layout.digest) and spec[4] == plan.sizes:
                return self._steady_speculated(group, res, plan, buf, spec)
        return self._finish(group, res, plan.sig, rows, plan.batch, plan.sizes, plan.device, None)

    def _steady_speculated(
        self, group: Group, res: "_LocalResult", plan: steady.SteadyPlan, buf: steady.RoundBuffers, spec: Any
    ) -> Any:
        """A steady call of a large single output: the data all-gather and the status round go together."""
        digest = plan.layout.digest
        block = plan.layout.segments(plan.rows)[1] if res.has_data else 0
        with torch.no_grad():
            also, ok = _speculative_buffers(spec, res, plan.sig, plan.rows, group, plan.device)
            header = [OK if res.has_data else EMPTY, plan.rows, plan.sig, digest, plan.batch, 0, block, ok]
            buf.write([comm.STATUS_ROUND, *header], ())
            comm.all_gather_pair(also, (buf.recv_flat, buf.send), group, self.call, self.timeout)
        table = buf.table.tolist()
        if all(row[comm.KIND] == comm.STATUS_ROUND and row[comm.SPECULATED] for row in table) and _clean(
            table, plan.sig, digest
        ):
            self._round = comm.next_round_size(table)  # and the speculation stays: same table, same layout
            index = spec[3]
            out = [leaf.value for leaf in plan.layout.leaves]
            out[index] = cut_rows(also[0], plan.sizes, spec[2]).movedim(0, plan.layout.leaves[index].out_dim)
            return tree_unflatten(out, plan.layout.spec)
        return self._steady_fallback(group, res, plan, buf, table, header, None, spec, also)

    def _steady_finish(
        self, group: Group, res: "_LocalResult", plan: steady.SteadyPlan, buf: steady.RoundBuffers
    ) -> Any:
        """The status round of a steady call whose outputs have the plan's layout, through reusable buffers."""
        digest = plan.layout.digest
        header = [OK if res.has_data else EMPTY, plan.rows, plan.sig, digest, plan.batch, 1, buf.block, 0]
        with torch.no_grad():
            buf.write([comm.STATUS_ROUND, *header], res.flat)
            comm.all_gather_into(buf.recv_flat, buf.send, group, self.call, self.timeout)
        table = buf.table.tolist()
        if all(row[comm.KIND] == comm.STATUS_ROUND and row[comm.PAYLOAD] for row in table) and _clean(
            table, plan.sig, digest
        ):
            self._round = comm.next_round_size(table)
            if self.dst != -1 and self.dst != group.rank:
                return None
            return tree_unflatten(buf.read(), plan.layout.spec)
        writer = _payload_writer(res, plan.rows, buf.block, plan.device) if res.has_data else None
        return self._steady_fallback(group, res, plan, buf, table, header, writer, None, None)

    def _steady_fallback(
        self,
        group: Group,
        res: "_LocalResult",
        plan: steady.SteadyPlan,
        buf: steady.RoundBuffers,
        table: List[List[int]],
        header: List[int],
        writer: Optional[Callable[[torch.Tensor], None]],
        spec: Optional[Tuple[Any, ...]],
        also: Optional[Tuple[torch.Tensor, torch.Tensor]],
    ) -> Any:
        """A steady round that was not clean: the general end of call from the same table, on every rank."""
        payloads = buf.payloads.clone()  # the buffers are reused by the next call
        if any(row[comm.KIND] != comm.STATUS_ROUND for row in table):  # a peer is still inside func: go on as usual
            with torch.no_grad():
                table, payloads = comm.exchange_status(
                    header, group, plan.device, self.call, self.timeout, writer, self._round
                )
        digest = plan.layout.digest
        return self._conclude(
            group, res, plan.sig, plan.rows, plan.sizes, plan.device, None, table, payloads, digest, spec, also
        )

    # -------------------------------------------------------- no distributed
    def _single(self, flat: FlatArgs, kwargs: Dict[str, Any]) -> Any:
        """One process: exactly ``torch.vmap`` (or the batched/loop equivalent) on the whole batch."""
        frame = None
        if self.axis_name is not None:
            B = flat.batch_size
            frame = context.AxisFrame(
                None,
                B,
                0,
                B,
                (B,),
                self.mode,
                False,
                _first_device(flat.leaves) or torch.device("cpu"),
                self.call,
                self.timeout,
            )
        with context.axis_scope(self.axis_name, frame):
            return self._run_shard(flat, flat.leaves, flat.batch_size, kwargs, frame)

    def _run_shard(
        self, flat: FlatArgs, shard: List[Any], rows: int, kwargs: Dict[str, Any], frame: Optional[context.AxisFrame]
    ) -> Any:
        if self.mode == "vmap" and frame is None and rows:
            if self._vmapped is None:
                self._vmapped = torch.vmap(
                    self.func, self.in_dims, self.out_dims, randomness=self.randomness, chunk_size=self.chunk_size
                )
            return self._vmapped(*flat.unflatten(shard), **kwargs)
        return run_shard(
            self.func,
            flat,
            shard,
            rows,
            kwargs,
            self.in_dims,
            self.out_dims,
            self.mode,
            self.randomness,
            self.chunk_size,
            self.call,
            frame,
        )

    # ------------------------------------------------------------ main path
    def _distributed(self, group: Group, flat: FlatArgs, kwargs: Dict[str, Any]) -> Any:
        anchor = _grad_anchor(flat.leaves, kwargs, self.func) if torch.is_grad_enabled() else None
        if anchor is not None and self.dst == -1:
            return self._run_with_grad(group, flat, kwargs)
        if anchor is None or self.dst == "local":  # dst="local": plain autograd on the shard
            return self._run(group, flat, kwargs, None)
        with torch.no_grad():
            out = self._run(group, flat, kwargs, None)
        return _not_differentiable(
            out,
            anchor,
            f"{self.call}: the output of a cmap with dst={self.dst!r} is not differentiable; use dst=-1 (every rank "
            f"gets the result and the gradients) or dst='local' (per-shard gradients).",
        )

    def _run(
        self, group: Group, flat: FlatArgs, kwargs: Dict[str, Any], recorder: Optional[autograd.GradRunner]
    ) -> Any:
        """Steps 3-8 for ``src`` None or "local"; returns the output pytree (None off ``dst``)."""
        local_src = self.src == "local"
        device = group_device(group, _first_device(flat.leaves))
        if local_src:
            rows, offset, sizes = flat.batch_size, None, None
            sig = self._input_sig(flat, kwargs, include_batch=False)
        else:
            sizes = split_for(self.dst)(flat.batch_size, group.size).sizes
            rows, offset = sizes[group.rank], sum(sizes[: group.rank])
            sig = self._input_sig(flat, kwargs, include_batch=True)
        if local_src and self.axis_name is not None:
            sizes = self._exchange_sizes(group, rows, device)
            offset = sum(sizes[: group.rank])
        shard = flat.leaves if local_src else take_local(flat.leaves, flat.dims, offset, rows)
        total = sum(sizes) if sizes is not None else None
        state = self._execute(group, flat, shard, rows, kwargs, sig, total, offset, sizes, device)
        return self._finish(group, state, sig, rows, flat.batch_size if not local_src else -1, sizes, device, recorder)

    def _execute(
        self,
        group: Group,
        flat: FlatArgs,
        shard: List[Any],
        rows: int,
        kwargs: Dict[str, Any],
        sig: int,
        total: Optional[int],
        offset: Optional[int],
        sizes: Optional[Sequence[int]],
        device: torch.device,
    ) -> "_LocalResult":
        """Run this rank's shard, capturing any exception for the status exchange."""
        result = _LocalResult()
        result.refs = [leaf for leaf, d in zip(shard, flat.dims) if d is not None]
        seed = self._seed(group, device)  # before any early return: "same" broadcasts, and every rank draws
        dummy = False
        if rows == 0 and total != 0:
            if self.axis_name is not None:
                # Collectives inside func need every rank: run one stand-in example that contributes nothing.
                shard, dummy = _stand_in(flat, shard, total is None), True
            else:
                result.layout = self._cached(sig)
                if result.layout is not None or total is not None:
                    return result
                dummy = True  # src="local" with an empty shard: the global batch may be empty too; probe the layout
        frame = None
        if self.axis_name is not None:
            frame = context.AxisFrame(
                group,
                total if total is not None else rows,
                offset or 0,
                rows,
                sizes,
                self.mode,
                dummy,
                device,
                self.call,
                self.timeout,
                round_bytes=self._round,
            )
        try:
            with rng_scope(self.randomness, seed, [device]) if seed is not None else contextlib.nullcontext(), (
                context.axis_scope(self.axis_name, frame) if frame is not None else contextlib.nullcontext()
            ):
                out = self._run_shard(flat, shard, 1 if dummy and frame is not None else rows, kwargs, frame)
            result.flat, spec = tree_flatten(out)
            cached = self._cached(sig)
            if cached is not None and cached.matches(result.flat, spec):
                result.layout = cached  # the common repeated call: no new layout, and its digest is already known
            else:
                result.layout = self._layout_of(result.flat, spec)
            if self.check_inputs and not dummy:
                result.checksums = replicated_checksums(result.flat, result.layout)
            result.has_data = not dummy
            result.dummy = dummy
        except Exception as exc:  # every rank learns of it in the status exchange
            if dummy and frame is None:
                return _LocalResult()
            result.failure = RankFailure.from_exception(exc, group.rank, group.global_rank)
            result.cause = exc
        return result

    def _layout_of(self, flat_out: List[Any], spec: Any) -> OutLayout:
        dims = flatten_out_dims(self.call, self.out_dims, spec, len(flat_out))
        dims = [
            d if not isinstance(v, torch.Tensor) else normalise_out_dim(self.call, d, v.dim() - 1, i)
            for i, (v, d) in enumerate(zip(flat_out, dims))
        ]
        return infer_layout(flat_out, dims, spec)

    def _finish(
        self,
        group: Group,
        res: "_LocalResult",
        sig: int,
        rows: int,
        batch: int,
        sizes: Optional[Sequence[int]],
        device: torch.device,
        recorder: Optional[autograd.GradRunner],
    ) -> Any:
        call = self.call
        status = FAILED if res.failure is not None else (OK if res.has_data else EMPTY)
        layout_sig = res.layout.digest if res.layout is not None else 0
        if res.checksums:  # check_inputs: out_dims=None outputs must also be equal across ranks
            layout_sig = zlib.crc32(repr(res.checksums).encode(), layout_sig) or 1
        nested = torch._C._functorch.maybe_current_level() is not None and (
            any(is_batched(v) for v in res.flat) or any(is_batched(v) for v in res.refs)
        )
        fits, block = self.dst != "local" and res.failure is None and not nested, 0
        round_bytes = self._round
        spec = self._speculate if not nested else None
        if fits and res.has_data:  # rows may be 0 (B=0): out_dims=None outputs still travel
            _, block = res.layout.segments(rows)
            fits = block <= round_bytes and spec is None
        payload = _payload_writer(res, rows, block, device) if fits and res.has_data and block else None

        with torch.no_grad():  # communication is never differentiated here (autograd.CmapFunction owns backward)
            also, spec_ok = None, 0
            if spec is not None:
                also, spec_ok = _speculative_buffers(spec, res, sig, rows, group, device)
            header = [status, rows, sig, layout_sig, batch, int(fits), block, spec_ok]
            table, payloads = comm.exchange_status(
                header, group, device, call, self.timeout, payload, round_bytes, also
            )
        return self._conclude(group, res, sig, rows, sizes, device, recorder, table, payloads, layout_sig, spec, also)

    def _conclude(
        self,
        group: Group,
        res: "_LocalResult",
        sig: int,
        rows: int,
        sizes: Optional[Sequence[int]],
        device: torch.device,
        recorder: Optional[autograd.GradRunner],
        table: List[List[int]],
        payloads: torch.Tensor,
        layout_sig: int,
        spec: Optional[Tuple[Any, ...]],
        also: Optional[Tuple[torch.Tensor, torch.Tensor]],
    ) -> Any:
        """After the status exchange: raise failures, agree on the layout, and gather (or read the payloads)."""
        call = self.call
        nested = torch._C._functorch.maybe_current_level() is not None and (
            any(is_batched(v) for v in res.flat) or any(is_batched(v) for v in res.refs)
        )
        if self.axis_name is None:  # with collectives inside func, every op round would carry the big payload too
            self._round = comm.next_round_size(table)
        sizes = [row[ROWS] for row in table] if sizes is None else list(sizes)
        if _clean(table, sig, layout_sig) and recorder is None and not nested and res.layout is not None:
            # The common repeated call: no failure, same inputs and output layout everywhere, nothing to agree on.
            layout = res.layout
            if self._layouts.get(sig) is not layout:
                self._remember(sig, layout)
            self._clean_call = (sig, layout, sizes, device)
        else:
            comm.raise_failures(table, res.failure, group, call, res.cause, self.timeout, device)
            _check_consistent(table, call, self.src)
            layout = self._agree_layout(group, table, res, sig, call, device)
        if layout is None:
            raise CmapError(
                f"{call}: the global batch is empty and func could not be run on an empty batch to "
                f"infer the output structure."
            )
        if res.has_data:
            local = res.flat
        elif res.dummy and res.flat:
            # Keep the stand-in's graph (0 rows of it, and its replicated values): backpropagating through these
            # outputs then reaches the backward collectives of psum & co. on this rank too, as on every other rank.
            local = [
                v.narrow(leaf.out_dim, 0, 0) if leaf.kind == BATCHED else v for v, leaf in zip(res.flat, layout.leaves)
            ]
        else:
            local = tree_flatten(layout.empty_outputs(device))[0]
        if nested:
            if self.dst not in (-1, "local"):
                raise CmapError(
                    f"{call}: inside an outer torch.vmap (nested cmap) only dst=-1 and 'local' are supported."
                )
            if not res.has_data:
                ref = next(v for v in res.refs if is_batched(v))
                local = [
                    batched_empty_like(ref, leaf.shape, leaf.dtype, leaf.out_dim) if leaf.kind == BATCHED else v
                    for v, leaf in zip(local, layout.leaves)
                ]
            if self.dst == -1:
                return tree_unflatten(gather_batched(local, layout, sizes, group, call, self.timeout), layout.spec)
        if recorder is not None and (res.has_data or res.dummy):
            producers = [r for r, row in enumerate(table) if row[STATUS] == OK]
            feeds = bool(producers) and producers[0] == group.rank
            _record(recorder, res.flat, layout, sum(sizes[: group.rank]), rows, res.dummy, feeds)
        if self.dst == "local":
            with torch.no_grad():  # an empty shard's copy of a replicated output has nothing to differentiate
                local = share_replicated(local, layout, sizes, group, device, call, self.timeout)
            return tree_unflatten(local, layout.spec)
        self._speculate = self._next_speculation(table, layout, sig, sizes, nested)
        if spec is not None and all(row[comm.SPECULATED] for row in table):
            # Every rank's outputs matched the previous call's layout: the data all-gather issued together with
            # the status round already holds the result.
            recv = cut_rows(also[0], sizes, spec[2])
            out = list(local)
            out[spec[3]] = recv.movedim(0, layout.leaves[spec[3]].out_dim)
            return tree_unflatten(out, layout.spec)
        if all(row[comm.PAYLOAD] for row in table):  # every rank's outputs already came with the status round
            if self.dst != -1 and self.dst != group.rank:
                return None
            return tree_unflatten(unpack(payloads, layout, sizes, sizes), layout.spec)
        with torch.no_grad():  # differentiable calls run inside autograd.CmapFunction, which owns the backward
            out = gather(local, layout, sizes, self.dst, group, device, call, self.timeout)
        return None if out is None else tree_unflatten(out, layout.spec)

    def _next_speculation(
        self, table: List[List[int]], layout: OutLayout, sig: int, sizes: Sequence[int], nested: bool
    ) -> Optional[Tuple[Any, ...]]:
        """From the gathered table alone (so every rank decides alike): may the next call speculate?"""
        if self.dst != -1 or self.src is not None or self.axis_name is not None or nested or sig == 0:
            return None
        if any(row[STATUS] == FAILED or row[INPUT_SIG] != sig for row in table):
            return None
        if max(row[comm.BLOCK] for row in table) <= comm.ROUND_MAX:  # the next status round will carry them
            return None
        tensors = [i for i, leaf in enumerate(layout.leaves) if leaf.kind != CONSTANT]
        if len(tensors) != 1 or layout.leaves[tensors[0]].kind != BATCHED or not max(sizes):
            return None
        leaf = layout.leaves[tensors[0]]
        return (sig, layout.digest, max(sizes), tensors[0], tuple(sizes), leaf.dtype, leaf.shape)

    def _agree_layout(
        self, group: Group, table: List[List[int]], res: "_LocalResult", sig: int, call: str, device: torch.device
    ) -> Optional[OutLayout]:
        data = [r for r, row in enumerate(table) if row[STATUS] == OK]
        if not data:
            return res.layout
        sigs = {table[r][LAYOUT_SIG] for r in data}
        if len(sigs) != 1:
            if self.check_inputs:  # the digests also cover out_dims=None values: tell which differs (rare path)
                _raise_unreplicated(group, res, data, call, self.timeout, device)
            raise CmapError(
                f"{call}: ranks returned outputs of different per-example shapes or dtypes; group ranks and layout "
                f"digests: {[(r, table[r][LAYOUT_SIG]) for r in data]}. cmap needs the same output structure "
                f"for every example."
            )
        ref = sigs.pop()
        layout = res.layout
        if any(row[LAYOUT_SIG] != ref for row in table):
            layout = comm.broadcast_object(
                res.layout if group.rank == data[0] else None, data[0], group, call, self.timeout, device
            )
        self._remember(sig, layout)
        return layout

    # --------------------------------------------------------------- autograd
    def _run_with_grad(self, group: Group, flat: FlatArgs, kwargs: Dict[str, Any]) -> Any:
        kw_leaves, kw_spec = tree_flatten(kwargs)
        module = self.func if isinstance(self.func, torch.nn.Module) else None
        params = dict(module.named_parameters()) if module is not None else {}
        slots: List[Tuple[str, Any]] = []
        tensors: List[torch.Tensor] = []
        for i, leaf in enumerate(flat.leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                slots.append(("arg", i))
                tensors.append(leaf)
        for i, leaf in enumerate(kw_leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                slots.append(("kw", i))
                tensors.append(leaf)
        for name, p in params.items():
            if p.requires_grad:
                slots.append(("param", name))
                tensors.append(p)
        holder: Dict[str, Any] = {}

        def forward(inputs: List[torch.Tensor]) -> List[torch.Tensor]:
            leaves, kws, prm = list(flat.leaves), list(kw_leaves), dict(params)
            for (kind, key), t in zip(slots, inputs):
                if kind == "arg":
                    leaves[key] = t
                elif kind == "kw":
                    kws[key] = t
                else:
                    prm[key] = t
            sub = FlatArgs(leaves, flat.dims, flat.spec, flat.batch_size)
            runner_self = self if module is None else _with_func(self, _functional(module, prm))
            out = runner_self._run(group, sub, tree_unflatten(kws, kw_spec), runner)
            leaves_out, spec = tree_flatten(out)
            holder["spec"], holder["flat"] = spec, leaves_out
            return [v for v in leaves_out if isinstance(v, torch.Tensor)]

        # Inputs every rank holds whole get the sum of the per-shard gradients; src="local" shards keep their own.
        reduce = [self.src is None or kind != "arg" or flat.dims[key] is None for kind, key in slots]
        runner = autograd.GradRunner(forward, group, self.call, self.timeout, reduce=reduce)
        outs = iter(autograd.apply(runner, tensors))
        flat_out = [next(outs) if isinstance(v, torch.Tensor) else v for v in holder["flat"]]
        return tree_unflatten(flat_out, holder["spec"])

    # ------------------------------------------------------------ src = rank
    def _call_from_src(self, group: Group, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        from .scatter import receive_shards

        if group.pg is None:
            return self._single(flatten_args(self.func, args, self.in_dims, self.call), kwargs)
        flat, shard, sizes, failure, device = receive_shards(self, group, args)
        rows, offset = sizes[group.rank], sum(sizes[: group.rank])
        total = sum(sizes)
        if failure is not None:
            res = _LocalResult()
            res.failure, res.cause = failure
            return self._finish(group, res, 0, rows, total, sizes, device, None)
        anchor = _grad_anchor(tree_flatten(args)[0], kwargs, self.func) if torch.is_grad_enabled() else None
        with torch.no_grad() if anchor is not None else contextlib.nullcontext():
            res = self._execute(group, flat, shard, rows, kwargs, 0, total, offset, sizes, device)
            out = self._finish(group, res, 0, rows, total, sizes, device, None)
        return _not_differentiable(
            out,
            anchor,
            f"{self.call}: the output of a cmap with src={self.src!r} is not differentiable: its inputs were "
            f"scattered from one rank. Use src=None to backpropagate to the inputs.",
        )

    # ---------------------------------------------------------------- helpers
    def _input_sig(self, flat: FlatArgs, kwargs: Dict[str, Any], include_batch: bool) -> int:
        if not kwargs and not self.check_inputs:
            # Memoised by the leaves' shapes, dtypes and dims (hashable); the spec (unhashable) is compared by ==.
            key = (include_batch,) + tuple(
                (leaf.shape, leaf.dtype, d) if isinstance(leaf, torch.Tensor) else (type(leaf), _const_key(leaf), d)
                for leaf, d in zip(flat.leaves, flat.dims)
            )
            for spec, sig in self._sigs.get(key, ()):
                if spec == flat.spec:
                    return sig
            sig = self._input_sig_slow(flat, kwargs, include_batch)
            if len(self._sigs) < _CACHE_SIZE:
                self._sigs.setdefault(key, []).append((flat.spec, sig))
            return sig
        return self._input_sig_slow(flat, kwargs, include_batch)

    def _input_sig_slow(self, flat: FlatArgs, kwargs: Dict[str, Any], include_batch: bool) -> int:
        parts: List[Any] = [flat.spec, self.mode]
        for leaf, d in zip(flat.leaves, flat.dims):
            if d is not None:
                shape = list(leaf.shape)
                if not include_batch:
                    del shape[d]
                parts.append((tuple(shape), leaf.dtype, d))
            elif isinstance(leaf, torch.Tensor):
                parts.append((tuple(leaf.shape), leaf.dtype))
            else:
                parts.append(leaf if isinstance(leaf, (int, float, bool, str, type(None))) else type(leaf).__name__)
        if kwargs:
            kw_leaves, kw_spec = tree_flatten(kwargs)
            parts.append(kw_spec)
            parts += [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in kw_leaves]
        sig = comm.digest(parts)
        if self.check_inputs:  # with src="local" the shards differ by design: only unmapped inputs must agree
            leaves = flat.leaves if self.src is None else [v for v, d in zip(flat.leaves, flat.dims) if d is None]
            sig = zlib.crc32(_content_bytes(leaves, kwargs), sig) or 1
        return sig

    def _cached(self, sig: int) -> Optional[OutLayout]:
        layout = self._layouts.get(sig)
        if layout is not None:
            self._layouts.move_to_end(sig)
        return layout

    def _remember(self, sig: int, layout: OutLayout) -> None:
        if sig == 0:
            return
        self._layouts[sig] = layout
        self._layouts.move_to_end(sig)
        while len(self._layouts) > _CACHE_SIZE:
            self._layouts.popitem(last=False)

    def _seed(self, group: Group, device: torch.device) -> Optional[int]:
        if self.randomness == "error":
            return None
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        if self.randomness == "same":
            t = torch.tensor([base], dtype=torch.int64, device=device)
            comm.broadcast(t, 0, group, self.call, self.timeout)
            return int(t.item())
        return (base + 1_000_003 * group.rank) % (2**63)

    def _exchange_sizes(self, group: Group, rows: int, device: torch.device) -> List[int]:
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        out = torch.empty(group.size, dtype=torch.int64, device=device)
        comm.all_gather_into(out, mine, group, self.call, self.timeout)
        return out.tolist()


class _LocalResult:
    def __init__(self) -> None:
        self.flat: List[Any] = []
        self.layout: Optional[OutLayout] = None
        self.has_data = False
        self.dummy = False
        self.refs: List[Any] = []  # the mapped shard leaves (batched when nested in an outer vmap)
        self.failure: Optional[RankFailure] = None
        self.cause: Optional[BaseException] = None
        self.checksums: Tuple[Tuple[int, int], ...] = ()  # check_inputs: crc32 of each out_dims=None output


def _clean(table: List[List[int]], sig: int, layout_sig: int) -> bool:
    """Whether every rank finished without failure, with these inputs and this output layout."""
    if not layout_sig:
        return False
    for row in table:
        if row[STATUS] == FAILED or row[INPUT_SIG] != sig or row[LAYOUT_SIG] != layout_sig:
            return False
    return True


def _check_consistent(table: List[List[int]], call: str, src: Placement) -> None:
    if src is not None and src != "local":
        return
    sigs = {row[INPUT_SIG] for row in table}
    batches = {row[BATCH] for row in table}
    if len(sigs) > 1 or len(batches) > 1:
        detail = ", ".join(
            f"group rank {r}: batch {row[BATCH] if row[BATCH] >= 0 else row[ROWS]} (signature {row[INPUT_SIG]:#x})"
            for r, row in enumerate(table)
        )
        what = "shard shapes, dtypes or structure, or in_dims=None inputs" if src == "local" else "inputs"
        raise CmapError(
            f"{call}: ranks passed different {what} ({detail}). With src=None every rank must pass the same full "
            f"inputs; use src=<rank> to scatter from one rank, or src='local' to pass per-rank shards."
        )


def _raise_unreplicated(
    group: Group, res: "_LocalResult", data: List[int], call: str, timeout: Optional[float], device: torch.device
) -> None:
    """Layout digests differ under check_inputs: if the structures agree, an out_dims=None output differs."""
    mine = (res.layout.digest, res.checksums) if res.has_data and res.layout is not None else None
    seen = comm.all_gather_object(mine, group, call, timeout, device)
    if len({seen[r][0] for r in data}) != 1:
        return  # the structure itself differs: the caller raises the general message
    sums = {r: dict(seen[r][1]) for r in data}
    bad = [i for i in sums[data[0]] if len({sums[r][i] for r in data}) > 1]
    detail = "; ".join(
        f"output leaf {i}: " + ", ".join(f"rank {r} crc32 {sums[r][i]:#010x}" for r in data) for i in bad
    )
    raise CmapError(
        f"{call}: an output declared replicated (out_dims=None) is not the same on every rank ({detail}). "
        f"out_dims=None promises one value shared by every example, such as the result of a psum; give the "
        f"output an int out_dim if it varies per example or per rank. (Found by check_inputs=True.)"
    )


def _record(
    runner: autograd.GradRunner,
    local: List[Any],
    layout: OutLayout,
    offset: int,
    rows: int,
    dummy: bool,
    feeds_replicated: bool,
) -> None:
    """Pair each local output with how to cut its gradient out of the global output's gradient.

    Batched leaves take this rank's rows. A replicated leaf (``out_dims=None``) is the same on every rank, so only
    one rank feeds its gradient back (collectives inside func carry it to the others): feeding it on every rank
    would multiply it by P. A stand-in example (empty shard) feeds zeros, only so that backward collectives meet.
    """
    k = 0
    for value, leaf in zip(local, layout.leaves):
        if not isinstance(value, torch.Tensor):
            continue
        if value.requires_grad:
            if dummy or (leaf.kind == REPLICATED and not feeds_replicated):
                runner.local_pairs.append((value, k, lambda g, v=value: torch.zeros_like(v)))
            elif leaf.kind == BATCHED:
                dim = leaf.out_dim
                runner.local_pairs.append((value, k, lambda g, d=dim: g.narrow(d, offset, rows)))
            else:
                runner.local_pairs.append((value, k, lambda g: g))
        k += 1


def _const_key(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


def _grad_anchor(leaves: Sequence[Any], kwargs: Dict[str, Any], func: Callable) -> Optional[torch.Tensor]:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    for leaf in tree_flatten(kwargs)[0] if kwargs else ():
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return leaf
    if isinstance(func, torch.nn.Module):
        for p in func.parameters():
            if p.requires_grad:
                return p
    return None


def _payload_writer(res: "_LocalResult", rows: int, block: int, device: torch.device) -> Callable[[torch.Tensor], None]:
    """Packs this rank's outputs straight into the status round's payload area."""

    def write(view: torch.Tensor) -> None:
        pack(res.flat, res.layout, rows, rows, device, out=view.narrow(0, 0, block))

    return write


def _speculative_buffers(
    spec: Tuple[Any, ...], res: "_LocalResult", sig: int, rows: int, group: Group, device: torch.device
) -> Tuple[Tuple[torch.Tensor, torch.Tensor], int]:
    """The data all-gather sized from the previous call (shared history, so every rank sends the same size), and
    whether this rank's outputs really fit it. A rank whose outputs do not fit sends garbage and says so."""
    _, digest, cap, index, sizes, dtype, shape = spec
    ok = res.failure is None and sig == spec[0] and rows == sizes[group.rank]
    ok = ok and (rows == 0 or (res.layout is not None and res.layout.digest == digest))
    send = None
    if ok and rows:
        leaf = res.layout.leaves[index]
        rows_view = res.flat[index] if leaf.out_dim == 0 else res.flat[index].movedim(leaf.out_dim, 0)
        if rows == cap and rows_view.is_contiguous():
            send = rows_view
        else:
            send = torch.empty((cap, *shape), dtype=dtype, device=device)
            send.narrow(0, 0, rows).copy_(rows_view)
    if send is None:
        send = torch.empty((cap, *shape), dtype=dtype, device=device)
    recv = torch.empty((group.size * cap, *shape), dtype=dtype, device=device)
    return (recv, send), int(ok)


def _stand_in(flat: FlatArgs, shard: List[Any], local_only: bool) -> List[Any]:
    """One example for an empty shard: the first global example when every rank holds the inputs, else zeros."""
    out = []
    for full, leaf, d in zip(flat.leaves, shard, flat.dims):
        if d is None:
            out.append(leaf)
        elif not local_only and full.shape[d] > 0:
            out.append(full.narrow(d, 0, 1))
        else:
            shape = list(leaf.shape)
            shape[d] = 1
            out.append(leaf.new_zeros(shape))
    return out


def _first_device(leaves: Sequence[Any]) -> Optional[torch.device]:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


def _not_differentiable(out: Any, anchor: Optional[torch.Tensor], message: str) -> Any:
    """Mark every tensor of ``out`` so that backpropagating through it raises ``message`` (no-op off dst)."""
    if anchor is None or out is None:
        return out
    leaves, spec = tree_flatten(out)
    marked = [autograd.not_differentiable(v, anchor, message) if isinstance(v, torch.Tensor) else v for v in leaves]
    return tree_unflatten(marked, spec)


def _content_bytes(leaves: Sequence[Any], kwargs: Dict[str, Any]) -> bytes:
    chunks = []
    for leaf in list(leaves) + tree_flatten(kwargs)[0]:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().contiguous().cpu().reshape(-1)
            chunks.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return b"".join(chunks)


def _functional(module: torch.nn.Module, params: Dict[str, torch.Tensor]) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, params, args, kwargs)

    call.__name__ = type(module).__name__
    return call


def _with_func(base: Cmapped, func: Callable) -> Cmapped:
    clone = object.__new__(Cmapped)
    clone.__dict__.update(base.__dict__)
    clone.func = func
    clone._vmapped = None
    return clone
