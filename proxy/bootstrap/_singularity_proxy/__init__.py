"""The in-job client of the singularity device proxy (standard library and torch only).

It makes torch in a job process see the devices the daemon gave it (SING_PROXY_SOCKETS) as
cuda:0..n-1; every operation on them runs in the device's proxy server. Modules, bottom up:
protocol (what both sides agree on), channel (connection, batching, parking), devices (the
process's devices), tensor (stand-ins and dispatch), sparse (sparse stand-ins), transfers,
randomness, mode (the torch-function mode: placement, factories, device-mix checks), cuda_surface
(torch.cuda and torch.accelerator), device_comm (nn.DataParallel's copies between devices),
serialization (torch.save / torch.load), composites (operators run whole), compiler (torch.compile
runs eagerly), higher_order (flex_attention and control flow by their dense implementation),
located_warnings (warnings shown at the program's line), collectives (collectives on stand-ins, run
by the servers), process_group (the "nccl" process group, DDP's buckets) and dtensors (DTensors of
stand-ins). Apart from the client, every job process maps multiprocessing's named semaphores so
that CRIU can dump them (semaphores). See
docs/proxy.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

ENV_SOCKETS = "SING_PROXY_SOCKETS"

_installed: list[Any] = []
"""The global torch-function mode, once the client is installed."""


def activate() -> bool:
    """Install the client if the daemon gave this process proxied devices; say whether it did."""
    sockets = os.environ.get(ENV_SOCKETS, "")
    if not sockets:
        return False
    if _installed:
        return True
    paths = [p for p in sockets.split(",") if p]
    rank = int(os.environ.get("RANK", "0") or 0)
    job_id = os.environ.get("SING_JOB_ID", "") or f"pid-{os.getpid()}"
    install(paths, job_id, rank)
    return True


def install(paths: Sequence[str], job_id: str, rank: int) -> None:
    """Install the client: the devices, the torch patches and the global mode."""
    from . import (
        compiler,
        composites,
        cpu_paths,
        cuda_surface,
        custom_functions,
        device_comm,
        dtensors,
        fast_paths,
        higher_order,
        numerics,
        process_group,
        serialization,
        sparse,
        tensor,
    )
    from .devices import DEVICES
    from .host_kernels import host_kernel_handler
    from .located_warnings import locate_warnings
    from .method_handlers import (
        group_by_proxied_device,
        materialize_lazy_modules_on_devices,
        move_modules_by_data_setter,
    )
    from .mode import DeviceMode, follow_default_device
    from .randomness import RANDOM_OPS, host_random_handler
    from .threads import enter_in_new_threads, enter_in_rpc_functions, hide_reader_threads
    from .transfers import TRANSFER_OPS

    DEVICES.configure(list(paths), job_id, rank)
    numerics.watch()
    tensor.special_ops.update(RANDOM_OPS)
    tensor.special_ops.update(TRANSFER_OPS)
    sparse.install()
    tensor.special_rules.append(host_random_handler)
    tensor.special_rules.append(host_kernel_handler)
    move_modules_by_data_setter()
    materialize_lazy_modules_on_devices()
    cuda_surface.patch_cuda()
    cuda_surface.patch_accelerator()
    cuda_surface.patch_autocast()
    cuda_surface.patch_generator()
    device_comm.install()
    serialization.install()
    composites.install()
    custom_functions.install()
    fast_paths.install()
    cpu_paths.install()
    higher_order.install()
    compiler.patch_compile()
    process_group.install()
    dtensors.install()
    locate_warnings()
    group_by_proxied_device()
    follow_default_device()
    mode = DeviceMode()
    mode.__enter__()  # type: ignore[no-untyped-call,unused-ignore]
    enter_in_new_threads(mode)
    hide_reader_threads()
    enter_in_rpc_functions()
    tensor.device_mode.append(mode)
    _installed.append(mode)
