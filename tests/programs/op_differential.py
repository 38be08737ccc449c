"""Differential check of torch's operators: each OpInfo sample run directly on the CPU and on `cuda`.

Run as a job on a proxied device (tests/proxy/test_op_coverage.py does). For every operator in
torch's OpInfo database, a few dtypes and the first samples of each, the samples are made
twice from the same seed, once for "cpu" and once for "cuda" (as torch's own CUDA tests make
them, so arguments that must stay on the host, views into larger storages and aliasing
between arguments are what a program on a real GPU would have). The two samples must be
equal; the operator then runs on each, and its outputs, and the inputs afterwards (in-place
operators), are compared bitwise: layout, shape, dtype, strides of outputs, and bits, a NaN
equal to any NaN. Prints one JSON line per operator started ({"begin": i, "name": ...,
"variant": ...}) and per failing sample, then {"done": counts}.

    python op_differential.py [--start I] [--samples N] [--only NAME ...] [--break NAME ...]
                              [--crash NAME ...]
"""

import argparse
import json
import os
import time
import warnings
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import SampleInput, op_db
from torch.utils._pytree import tree_map

DTYPES = (torch.float32, torch.int64, torch.bool, torch.complex64)

SAMPLES_DIFFER_ON_CUDA = {
    "linalg.ldl_solve": "OpInfo draws Hermitian matrices only for the CPU, so later random inputs differ",
}
"""Operators whose OpInfo samples for cuda have other values than for the cpu, by design: the host
sample's tensors are copied to the device instead."""


def _inherently_nondeterministic(op: Any, sample: Any) -> str:
    """Why two direct CPU runs of this sample may differ ('' when they do not)."""
    if op.name == "linalg.lstsq" and sample.kwargs.get("driver") == "gelsy":
        return "LAPACK's gelsy gives other bits from run to run on rank-deficient input"
    return ""


UNINITIALISED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
"""Operators whose output values are whatever memory held: only their layout, shape, dtype and
strides are compared."""

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (every NaN made the same NaN)."""
    tensor = tensor.resolve_conj().resolve_neg()
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor)
    if tensor.dtype.is_floating_point:
        tensor = tensor.masked_fill(tensor.isnan(), float("nan"))
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.contiguous().view(_INTEGER_OF_SIZE[tensor.element_size()])


def difference(ref: Any, got: Any, where: str, on_device: bool = True, values: bool = True) -> str:
    """How `got` differs from `ref` ('' when it does not).

    With `on_device`, every tensor in `got` must be on the device; with `values` False, only
    the metadata is compared.
    """
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: a {type(got).__name__}, not a tensor"
        if on_device and got.device.type != "cuda":
            return f"{where}: on {got.device}, not on the device"
        if ref.layout != got.layout:
            return f"{where}: layout {got.layout}, not {ref.layout}"
        if ref.shape != got.shape or ref.dtype != got.dtype:
            return f"{where}: {tuple(got.shape)} {got.dtype}, not {tuple(ref.shape)} {ref.dtype}"
        if ref.layout != torch.strided:
            ref, got = ref.to_dense(), got.to_dense()
        elif ref.stride() != got.stride() and ref.numel() > 1:
            return f"{where}: strides {got.stride()}, not {ref.stride()}"
        if values and not torch.equal(_bits(ref), _bits(got.cpu())):
            return f"{where}: values differ"
        return ""
    if isinstance(ref, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(ref) != len(got):
            return f"{where}: {got!r:.60}, not {len(ref)} items"
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            found = difference(r, g, f"{where}[{i}]", on_device, values)
            if found:
                return found
        return ""
    if isinstance(ref, dict):
        if not isinstance(got, dict) or ref.keys() != got.keys():
            return f"{where}: {got!r:.60}, not {ref!r:.60}"
        return difference(list(ref.values()), list(got.values()), where, on_device, values)
    if _is_device(ref) and _is_device(got):
        return ""
    if isinstance(ref, torch.nn.Module) and type(ref) is type(got):
        return ""
    if isinstance(ref, float) and isinstance(got, float) and ref != ref and got != got:
        return ""
    if type(ref) is not type(got) or ref != got:
        return f"{where}: {got!r:.60}, not {ref!r:.60}"
    return ""


def _is_device(value: Any) -> bool:
    return isinstance(value, torch.device) or value in ("cpu", "cuda")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _perturbed(value: Any) -> Any:
    """A wrong result, for the test that shows a wrong result is caught."""
    if isinstance(value, torch.Tensor):
        return value.logical_not() if value.dtype == torch.bool else value + 1
    return value


def _arguments(sample: Any) -> list[Any]:
    return [sample.input, sample.args, sample.kwargs]


def _copied_to_device(sample: Any) -> Any:
    """A host sample with its tensors copied to the device."""

    def to_device(value: Any) -> Any:
        return value.to("cuda") if isinstance(value, torch.Tensor) else value

    return SampleInput(
        tree_map(to_device, sample.input),
        args=tree_map(to_device, sample.args),
        kwargs=tree_map(to_device, sample.kwargs),
    )


def _run(op: Any, sample: Any) -> tuple[Any, BaseException | None]:
    """The operator's output on a sample (from seed 0), or the exception it raised."""
    try:
        torch.manual_seed(0)
        return op(sample.input, *sample.args, **sample.kwargs), None
    except Exception as e:
        return None, e


def check(op: Any, host: Any, again: Any, device: Any | None, broken: bool = False) -> tuple[str, str]:
    """(outcome, detail) of one sample: ok, fail, both-error, host-error-only, nondeterministic.

    Samples known to give other bits from run to run on the CPU itself are not compared; as a
    net for others, `again` (the same sample made a second time for the host) runs too, and
    a sample whose two host runs differ is not compared either. Where OpInfo makes another
    sample for cuda than for the cpu (or none), the host sample's tensors are copied to the
    device instead.
    """
    if (
        device is None
        or op.name in SAMPLES_DIFFER_ON_CUDA
        or difference(_arguments(host), _arguments(device), "sample", on_device=False, values=False)
    ):
        try:
            device = _copied_to_device(host)
        except Exception as e:
            return "fail", f"copying the sample to the device: {_first_line(e)}"
    found = difference(_arguments(host), _arguments(device), "sample", on_device=False)
    if found:
        return "fail", f"making the sample on the device: {found}"
    reason = _inherently_nondeterministic(op, host)
    if reason:
        return "nondeterministic", reason
    ref, ref_error = _run(op, host)
    if op.name not in UNINITIALISED:
        second, second_error = _run(op, again)
        if (ref_error is None) != (second_error is None):
            return "nondeterministic", "it raised in one of two host runs only"
        found = "" if ref_error else difference(ref, second, "output", on_device=False)
        if found:
            return "nondeterministic", f"two host runs differ: {found}"
    try:
        torch.manual_seed(0)
        got = op(device.input, *device.args, **device.kwargs)
        if broken:
            got = tree_map(_perturbed, got)
    except Exception as e:
        if ref_error is None:
            return "fail", _first_line(e)
        if type(e) is not type(ref_error):
            return "fail", f"raised {_first_line(e)}, not {_first_line(ref_error)}"
        return "both-error", ""
    if ref_error is not None:
        return "host-error-only", _first_line(ref_error)
    try:
        found = difference(ref, got, "output", values=op.name not in UNINITIALISED)
        if not found:
            found = difference(_arguments(host), _arguments(device), "inputs after", on_device=False)
    except Exception as e:
        found = f"comparing: {_first_line(e)}"
    return ("fail", found) if found else ("ok", "")


def _samples(op: Any, device: str, dtype: torch.dtype, count: int) -> list[Any]:
    """The first `count` samples of an operator for a device, made from seed 0."""
    torch.manual_seed(0)
    samples = []
    for sample in op.sample_inputs(device, dtype, requires_grad=False):
        samples.append(sample)
        if len(samples) == count:
            break
    return samples


def main() -> None:
    """Run the samples from the operator numbered --start on, printing JSON lines."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=[], help="only these operators")
    parser.add_argument("--break", dest="broken", nargs="*", default=[], help="falsify these operators")
    parser.add_argument("--crash", nargs="*", default=[], help="end the process abruptly at these")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    counts: dict[str, int] = {}
    started = time.monotonic()
    for index, op in enumerate(op_db):
        if index < options.start or (options.only and op.name not in options.only):
            continue
        print(json.dumps({"begin": index, "name": op.name, "variant": op.variant_test_name}), flush=True)
        if op.name in options.crash:
            os._exit(3)
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            try:
                host_samples = _samples(op, "cpu", dtype, options.samples)
                second_samples = _samples(op, "cpu", dtype, options.samples)
            except Exception:
                continue  # OpInfo cannot make samples of this dtype
            try:
                device_samples = _samples(op, "cuda", dtype, options.samples)
            except Exception as e:
                results = [("fail", f"making the samples on the device: {_first_line(e)}")]
            else:
                padded = [*device_samples, *[None] * len(host_samples)]
                results = [
                    check(op, host, again, device, op.name in options.broken)
                    for host, again, device in zip(host_samples, second_samples, padded, strict=False)
                ]
            for number, (outcome, detail) in enumerate(results):
                counts[outcome] = counts.get(outcome, 0) + 1
                if outcome in ("fail", "nondeterministic"):
                    line = {
                        "outcome": outcome,
                        "op": op.name,
                        "variant": op.variant_test_name,
                        "dtype": str(dtype).removeprefix("torch."),
                        "sample": number,
                        "error": detail,
                    }
                    print(json.dumps(line), flush=True)
    print(json.dumps({"done": counts, "seconds": round(time.monotonic() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
