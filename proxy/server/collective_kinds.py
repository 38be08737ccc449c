"""What each collective computes, given its members' data here and the parts other servers send.

Each kind is a driver run once per server and instance (collectives.Exchange): it offers the
parts of local members' data that other servers need, keyed by where they come from, waits for
the parts it needs, and writes the local members' outputs. Reductions fold the members' values
in global rank order (((x0 + x1) + x2) + ...), element by element, so the bits do not depend on
how the ranks are spread over devices; for two ranks that is what gloo computes (a + b).

An allreduce over several servers is a reduce-scatter then an all-gather: the flattened tensor
is cut into one chunk per server, each server folds its chunk from every rank's part, then sends
the folded chunk to the others. Data moves once to where it is needed, and no server folds more
than its share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .collectives import Exchange

Key = tuple[Any, ...]
Offer = tuple[Sequence[int], torch.Tensor]
"""A part of this server's data and the servers it goes to."""


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as one dimension (a view when it is contiguous)."""
    return tensor.reshape(-1)


def write(target: torch.Tensor, values: torch.Tensor) -> None:
    """Put these values (in order) into a member's tensor, whatever its layout (`copy_` bumps its
    version counter, so a pre-copy of device state sees the write: snapshot.py)."""
    if values.numel() != target.numel():
        raise RuntimeError(
            f"proxy: mismatched collective: {values.numel()} elements arrived "
            f"for a tensor of {target.numel()}"
        )
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def write_alike(
    x: Exchange, targets: Sequence[tuple[int, torch.Tensor]], values: torch.Tensor, first_holds: bool = False
) -> None:
    """Put the same values into several local members' tensors (group rank, tensor): the first
    is written (unless it already holds them), and each other one takes its storage where that
    gives it the same bytes (spliced replicas: kept once and copy-on-write, dedup.py), else is
    written too."""
    first_rank, first = targets[0]
    writer = x.instance.sessions[first_rank]
    if not first_holds:
        writer.swap_in_overwritten(first)
        write(first, values)
    dedup = x.collectives.dedup
    for rank, tensor in targets[1:]:
        session = x.instance.sessions[rank]
        session.swap_in_overwritten(tensor)
        if dedup is None or not dedup.share_alike(writer, first, session, tensor):
            write(tensor, values)


def fold(
    values: Sequence[torch.Tensor],
    op: str,
    factor: float,
    size: int,
    device: torch.device | None = None,
    into_first: bool = False,
) -> torch.Tensor:
    """The reduction of the values in the order given (global rank order), on `device` (values
    read from host memory are brought there one at a time; by default the first value's); with
    `into_first`, computed in the first value itself (on the device), which is returned."""
    shape = values[0].shape
    for value in values:
        if value.shape != shape:
            raise RuntimeError(
                f"proxy: mismatched collective: parts of {list(shape)} and {list(value.shape)}"
            )
    device = device or values[0].device
    with torch.no_grad():
        if op == "premul_sum":
            result = values[0].mul_(factor) if into_first else values[0].to(device) * factor
            for value in values[1:]:
                result.add_(value.to(device) * factor)
            return result
        result = values[0] if into_first else values[0].to(device, copy=True)
        combine = _COMBINE[op]
        for value in values[1:]:
            combine(result, value.to(device))
        if op == "avg":
            if result.is_floating_point() or result.is_complex():
                result.div_(size)
            else:
                result.div_(size, rounding_mode="trunc")
        return result


_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,
    "product": torch.Tensor.mul_,
    "min": lambda a, b: torch.where(b < a, b, a, out=a),  # std::min's, as gloo: a NaN keeps `a`
    "max": lambda a, b: torch.where(a < b, b, a, out=a),
    "band": torch.Tensor.bitwise_and_,
    "bor": torch.Tensor.bitwise_or_,
    "bxor": torch.Tensor.bitwise_xor_,
}


def exchange(x: Exchange, offers: Mapping[Any, Offer], needs: set[Any]) -> dict[Key, torch.Tensor]:
    """Send each offered part to the servers listed with it; every needed part, local or received."""
    for key, (servers, tensor) in offers.items():
        for server in sorted(set(servers)):
            if server != x.me:
                x.send(server, key, tensor)
    received = x.wait({key for key in needs if key not in offers})
    return {key: offers[key][1] if key in offers else received[key] for key in needs}


def with_arrivals(
    x: Exchange, offers: Mapping[Key, Offer], needs: set[Key]
) -> tuple[dict[Key, Offer], set[Key]]:
    """These offers and needs, plus a mark from every member that it has reached the collective.

    For kinds where a server needs no data from some others (a broadcast's or scatter's root, the
    members of a gather or reduce that are not its root): without the marks that server would
    complete while another has not reached the collective, and a checkpoint taken then would hold
    a collective complete for one rank and not started for another (collectives.py, consistent cuts).
    """
    empty = torch.empty(0, dtype=torch.uint8)
    marks = {("m", rank): (x.servers, empty) for rank in x.local}
    return {**offers, **marks}, needs | {("m", rank) for rank in range(x.size)}


def _count(x: Exchange, name: str) -> int:
    """How many tensors (or lists) the members give under `name`: the same for every local member."""
    counts = {len(x.params[rank][name]) for rank in x.local}
    if len(counts) != 1:
        raise RuntimeError(f"proxy: mismatched collective: members give {sorted(counts)} {name}")
    return counts.pop()


def _readable_flats(x: Exchange, ranks: Sequence[int]) -> dict[int, list[torch.Tensor]]:
    """Each of these members' tensors, flat, as the driver reads them: over their host bytes where
    they wait in host memory. Taken under the device lock, so that no storage comes back from host
    memory meanwhile (Session.readable)."""
    sessions = x.instance.sessions
    with x.device_lock:
        return {rank: [flat(sessions[rank].readable(t)) for t in x.params[rank]["tensors"]] for rank in ranks}


def allreduce(x: Exchange) -> None:
    """Every member's tensors become the reduction of all members' (in place)."""
    count = _count(x, "tensors")
    if x.servers == [x.me] and all(_distinct_storages(x.params[rank]["tensors"]) for rank in x.local):
        _allreduce_here(x, count)
        return
    flats = _readable_flats(x, x.local)
    try:
        _allreduce_across(x, count, flats)
    finally:
        with x.device_lock:
            for rank in x.local:
                x.instance.sessions[rank].done_reading()


def _allreduce_across(x: Exchange, count: int, flats: dict[int, list[torch.Tensor]]) -> None:
    """`allreduce` over several servers: each reduces its slice of every tensor, then all gather."""
    servers, position = x.servers, x.servers.index(x.me)
    sizes = [flats[x.local[0]][i].numel() for i in range(count)]
    bounds = [[n * j // len(servers) for j in range(len(servers) + 1)] for n in sizes]
    offers = {
        ("a", i, j, rank): ([server], flats[rank][i][bounds[i][j] : bounds[i][j + 1]])
        for rank in x.local
        for i in range(count)
        for j, server in enumerate(servers)
    }
    needs = {("a", i, position, rank) for i in range(count) for rank in range(x.size)}
    parts = exchange(x, offers, needs)
    with x.device_lock:
        folded = [
            fold(
                [parts[("a", i, position, rank)] for rank in range(x.size)],
                x.op,
                x.factor,
                x.size,
                x.collectives.device,
            )
            for i in range(count)
        ]
    shares = {("b", i, position): (servers, folded[i]) for i in range(count)}
    chunks = exchange(x, shares, {("b", i, j) for i in range(count) for j in range(len(servers))})
    with x.device_lock:
        for i in range(count):
            pieces = [chunks[("b", i, j)] for j in range(len(servers))]
            whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            write_alike(x, [(rank, x.params[rank]["tensors"][i]) for rank in x.local], whole)


def _allreduce_here(x: Exchange, count: int) -> None:
    """`allreduce` with every member on this device: each tensor of rank 0 folds the others' into
    itself, in rank order (the same bits as a fold into a new tensor), and the others take the
    result; no result buffer is made and rank 0's values are not copied."""
    sessions = x.instance.sessions
    lead = x.params[0]["tensors"]
    others = x.local[1:]
    with x.device_lock:
        flats = _readable_flats(x, others)
        sessions[0].swap_in_tensors(lead)  # its values are the first the fold takes
        for i, tensor in enumerate(lead):
            values = [flat(tensor), *(flats[rank][i] for rank in others)]
            folded = fold(values, x.op, x.factor, x.size, x.collectives.device, into_first=True)
            for rank in others:  # their host bytes are read: they may be handed back to the device
                sessions[rank].done_reading(x.params[rank]["tensors"][i])
            targets = [(rank, x.params[rank]["tensors"][i]) for rank in x.local]
            write_alike(x, targets, folded, first_holds=True)


def _distinct_storages(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor of a member is contiguous and has a storage of its own among them: then
    folding into one in place, or bringing one back from host memory, changes no other's values."""
    keys = {tensor.untyped_storage()._cdata for tensor in tensors}
    return len(keys) == len(tensors) and all(tensor.is_contiguous() for tensor in tensors)


def broadcast(x: Exchange) -> None:
    """Every member's tensors become the root's."""
    count = _count(x, "tensors")
    root = x.root
    offers = {}
    if root in x.params:
        offers = {("c", i, root): (x.servers, flat(t)) for i, t in enumerate(x.params[root]["tensors"])}
    parts = exchange(x, *with_arrivals(x, offers, {("c", i, root) for i in range(count)}))
    with x.device_lock:
        for rank in x.local:
            if rank != root:
                for i, tensor in enumerate(x.params[rank]["tensors"]):
                    write(tensor, parts[("c", i, root)])


def _gathered(x: Exchange, only_to: int | None = None) -> dict[Key, torch.Tensor]:
    """Every member's inputs, here (to the servers of all members, or only of group rank `only_to`)."""
    count = _count(x, "inputs")
    servers = x.servers if only_to is None else [x.placement[only_to]]
    offers = {
        ("c", i, rank): (servers, flat(tensor))
        for rank in x.local
        for i, tensor in enumerate(x.params[rank]["inputs"])
    }
    wanted = only_to is None or only_to in x.params
    needs = {("c", i, rank) for i in range(count) for rank in range(x.size)} if wanted else set()
    if only_to is not None:
        return exchange(x, *with_arrivals(x, offers, needs))
    return exchange(x, offers, needs)


def allgather(x: Exchange) -> None:
    """Every member's output lists get every member's inputs, in rank order."""
    parts = _gathered(x)
    with x.device_lock:
        for rank in x.local:
            for i, outputs in enumerate(x.params[rank]["outputs"]):
                _check_list(outputs, x.size, "output")
                for source, output in enumerate(outputs):
                    write(output, parts[("c", i, source)])


def allgather_into_tensor(x: Exchange) -> None:
    """Every member's output tensor gets every member's input, concatenated in rank order."""
    parts = _gathered(x)
    with x.device_lock:
        for rank in x.local:
            for i, output in enumerate(x.params[rank]["outputs"]):
                write(output, torch.cat([parts[("c", i, source)] for source in range(x.size)]))


def gather(x: Exchange) -> None:
    """The root's output list gets every member's input."""
    parts = _gathered(x, only_to=x.root)
    if x.root in x.params:
        with x.device_lock:
            for i, outputs in enumerate(x.params[x.root]["outputs"]):
                _check_list(outputs, x.size, "output")
                for source, output in enumerate(outputs):
                    write(output, parts[("c", i, source)])


def scatter(x: Exchange) -> None:
    """Each member's output gets its part of the root's input list."""
    count = _count(x, "outputs")
    offers: dict[Key, tuple[Sequence[int], torch.Tensor]] = {}
    if x.root in x.params:
        for i, inputs in enumerate(x.params[x.root]["inputs"]):
            _check_list(inputs, x.size, "input")
            for target, tensor in enumerate(inputs):
                offers[("c", i, target)] = ([x.placement[target]], flat(tensor))
    parts = exchange(x, *with_arrivals(x, offers, {("c", i, rank) for i in range(count) for rank in x.local}))
    with x.device_lock:
        for rank in x.local:
            for i, output in enumerate(x.params[rank]["outputs"]):
                write(output, parts[("c", i, rank)])


def _reduce_blocks(
    x: Exchange, block: Callable[[int, int, int], torch.Tensor], targets: list[int], count: int
) -> dict[tuple[int, int], torch.Tensor]:
    """Fold block(rank, i, t) of every member for each target group rank t, where t runs: {(i, t): result}."""
    offers: dict[Key, Offer] = {
        ("a", i, target, rank): ([x.placement[target]], flat(block(rank, i, target)))
        for rank in x.local
        for i in range(count)
        for target in targets
    }
    mine = [target for target in targets if target in x.params]
    needs = {("a", i, t, rank) for i in range(count) for t in mine for rank in range(x.size)}
    if len(targets) < x.size:
        offers, needs = with_arrivals(x, offers, needs)
    parts = exchange(x, offers, needs)
    with x.device_lock:
        return {
            (i, t): fold([parts[("a", i, t, rank)] for rank in range(x.size)], x.op, x.factor, x.size)
            for i in range(count)
            for t in mine
        }


def reduce_scatter(x: Exchange) -> None:
    """Each member's output is the reduction of every member's input block of its rank."""
    count = _count(x, "outputs")

    def block(rank: int, i: int, target: int) -> torch.Tensor:
        inputs = x.params[rank]["inputs"][i]
        if isinstance(inputs, list):
            _check_list(inputs, x.size, "input")
            return inputs[target]  # type: ignore[no-any-return]
        piece = x.params[rank]["outputs"][i].numel()
        if inputs.numel() != piece * x.size:
            raise RuntimeError(
                f"proxy: reduce_scatter input of {inputs.numel()} elements "
                f"for outputs of {piece} and {x.size} ranks"
            )
        return flat(inputs)[piece * target : piece * (target + 1)]

    results = _reduce_blocks(x, block, list(range(x.size)), count)
    with x.device_lock:
        for (i, target), value in results.items():
            write(x.params[target]["outputs"][i], value)


def reduce(x: Exchange) -> None:
    """The root's tensors become the reduction of every member's."""
    count = _count(x, "tensors")
    results = _reduce_blocks(x, lambda rank, i, _target: x.params[rank]["tensors"][i], [x.root], count)
    with x.device_lock:
        for (i, target), value in results.items():
            write(x.params[target]["tensors"][i], value)


def alltoall(x: Exchange) -> None:
    """Each member's output gets, from every member in rank order, the part of its input for it."""
    count = _count(x, "outputs")

    def parts_of(rank: int, i: int) -> list[torch.Tensor]:
        params = x.params[rank]
        inputs = params["inputs"][i]
        if isinstance(inputs, list):
            _check_list(inputs, x.size, "input")
            return [flat(t) for t in inputs]
        splits = params["input_splits"] or [inputs.shape[0] // x.size] * x.size
        if sum(splits) != inputs.shape[0] or len(splits) != x.size:
            raise RuntimeError(f"proxy: all_to_all input splits {splits} do not cover {inputs.shape[0]} rows")
        return [flat(t) for t in inputs.split(splits)]

    offers = {
        ("t", i, rank, target): ([x.placement[target]], part)
        for rank in x.local
        for i in range(count)
        for target, part in enumerate(parts_of(rank, i))
    }
    needs = {("t", i, source, rank) for rank in x.local for i in range(count) for source in range(x.size)}
    parts = exchange(x, offers, needs)
    with x.device_lock:
        for rank in x.local:
            for i, output in enumerate(x.params[rank]["outputs"]):
                received = [parts[("t", i, source, rank)] for source in range(x.size)]
                if isinstance(output, list):
                    _check_list(output, x.size, "output")
                    for tensor, values in zip(output, received, strict=True):
                        write(tensor, values)
                else:
                    write(output, torch.cat(received))


def barrier(x: Exchange) -> None:
    """Completes once every member has reached it."""
    exchange(x, *with_arrivals(x, {}, set()))


def _check_list(tensors: Any, size: int, what: str) -> None:
    if not isinstance(tensors, list) or len(tensors) != size:
        raise ValueError(f"proxy: the {what} list must hold one tensor per rank of the group ({size})")


KINDS: dict[str, Callable[[Exchange], None]] = {
    "allreduce": allreduce,
    "broadcast": broadcast,
    "allgather": allgather,
    "allgather_into_tensor": allgather_into_tensor,
    "gather": gather,
    "scatter": scatter,
    "reduce_scatter": reduce_scatter,
    "reduce": reduce,
    "alltoall": alltoall,
    "barrier": barrier,
}
"""The driver of each kind of collective (operators.COLLECTIVES names the kind of each operator)."""
