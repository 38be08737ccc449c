"""What a program sees on a proxied device: errors, out of memory, API surface, no CUDA state."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proxy.conftest import (
    PROGRAMS,
    PYTHON,
    ProxyServer,
    base_env,
    proxy_env,
    run_program,
    start_server,
    stop_server,
)


def outputs_on_cpu_and_device(program: str, server: ProxyServer) -> tuple[str, str]:
    """What the program prints run directly with argument `cpu`, then proxied with `cuda`."""
    direct = run_program([program, "cpu"], base_env())
    proxied = run_program([program, "cuda"], proxy_env([server.socket], program.removesuffix(".py")))
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    return direct.stdout, proxied.stdout


def test_program_errors_match_direct_run(server: ProxyServer) -> None:
    direct, proxied = outputs_on_cpu_and_device("probe_errors.py", server)
    assert "mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)" in direct
    assert proxied == direct


def test_storage_addresses_and_sizes_relate_as_in_a_direct_run(server: ProxyServer) -> None:
    """Views share their storage's address, distinct storages lie apart, tied weights are found."""
    direct, proxied = outputs_on_cpu_and_device("probe_storage.py", server)
    assert "shared [['embed.weight', 'head.weight'], ['other.bias'], ['other.weight']]" in direct
    assert proxied == direct


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ProxyServer]:
    s = start_server(tmp_path, "small", memory_bytes=16 << 20)
    yield s
    stop_server(s)


def test_out_of_memory_on_small_device(small_server: ProxyServer) -> None:
    r = run_program(["probe_oom.py"], proxy_env([small_server.socket], "oom"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"total {16 << 20}",
        "big OutOfMemoryError True",
        "small OutOfMemoryError True",
        "allocated before free True",
        "allocated after free 40",  # exact bytes of the one live tensor
        "sum 10.0",
    ]


def test_job_process_holds_no_cuda_state(server: ProxyServer) -> None:
    r = run_program(["probe_no_cuda.py"], proxy_env([server.socket], "nocuda"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "available True count 1"
    assert "nvidia fds []" in lines
    assert "cuda libraries []" in lines
    assert "real lazy init ran False" in lines


def test_api_surface_and_portable_save(server: ProxyServer, tmp_path: Path) -> None:
    path = tmp_path / "saved.pt"
    r = run_program(["probe_api.py", str(path)], proxy_env([server.socket], "api"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for line in [
        "available True True",
        "count 1 1",
        "cuda version True",
        "device_of 0 0",
        "pinned True True True",
        "not pinned False [0.0, 0.0, 0.0]",
        "accelerator cuda",
        "current 0 0",
        "name Singularity Virtual Device",
        f"total_memory {1 << 30} capability (8, 0)",
        "allocated 1048576",
        "after del 0 peak True",
        "peak reset 0",
        f"peak of four made and freed in turn {256 << 10}",
        "mem_get_info True True",
        "elapsed True 100.0",
        "generic event Stream True True",
        "untimed Both events must be created with argument 'enable_timing=True'.",
        "nvml True True",
        "processes True",
        "peer False 0",
        "ordinal CUDA error: invalid device ordinal\nordinal CUDA error: invalid device ordinal",
        "tensor([[0., 1., 2.],\n        [3., 4., 5.]], device='cuda:0')",
        "cuda:0 True 0 cpu [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]",
        "item 5.0 tolist [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]",
        "numpy can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
        "tensor to host memory first.",
        "asarray can't convert cuda:0 device type tensor to numpy.",
        "to_dlpack refused True",
        "__dlpack__ refused True",
        "from_dlpack True True",
        "cuda_array_interface False",
        "apply_ apply_ is only implemented on CPU tensors",
        "map_ map_ is only implemented on CPU tensors",
        "mixed Expected all tensors to be on the same device",
        "default device cuda:0",
        "deepcopy cuda:0 True True",
        "deepcopy grads None True",
        "grad cuda:0 18.0",
        "load cuda:0 True True",
        "load cpu cpu cpu",
        "rng state restored True True",
        "linalg library _LinalgBackend.Cusolver _LinalgBackend.Cusolver",
        "blas library _BlasBackend.Cublaslt _BlasBackend.Cublaslt",
        "cufft plans 0 32 32 None",
    ]:
        assert line in out, (line, out)
    assert "Parameter containing:\ntensor([" in out and "device='cuda:0', requires_grad=True)" in out
    # the file is what torch writes for cuda tensors: a plain torch loads it with map_location
    check = (
        "import torch, sys\n"
        "d = torch.load(sys.argv[1], map_location='cpu')\n"
        "print(d['x'].tolist(), type(d['param']).__name__, sorted(d['model']))\n"
        "try:\n    torch.load(sys.argv[1])\nexcept Exception as e:\n    print('cuda' in str(e))\n"
    )
    plain = subprocess.run(
        [PYTHON, "-c", check, str(path)],
        env=base_env(),
        cwd=PROGRAMS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines() == [
        "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] Parameter ['bias', 'weight']",
        "True",
    ]


def test_transfers_larger_than_a_frame_match_direct_run(server: ProxyServer) -> None:
    direct = run_program(["probe_large.py", "cpu"], base_env())
    proxied = run_program(["probe_large.py", "cuda"], proxy_env([server.socket], "large"))
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    assert "download" in direct.stdout and "True" in direct.stdout
    assert proxied.stdout == direct.stdout


def test_threads_of_the_program_use_the_proxied_device(server: ProxyServer) -> None:
    """A DataLoader's pin-memory thread, a thread and a thread pool work on the device as on a GPU."""
    direct = run_program(["threads_on_device.py", "cpu"], base_env())
    proxied = run_program(["threads_on_device.py", "cuda"], proxy_env([server.socket], "threads"))
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    assert proxied.stdout == direct.stdout
    assert len(proxied.stdout.splitlines()) == 9 and " False " not in proxied.stdout


def test_tensors_asked_for_on_the_host_are_made_there(server: ProxyServer) -> None:
    direct = run_program(["probe_placement.py", "cpu"], base_env())
    proxied = run_program(["probe_placement.py", "cuda"], proxy_env([server.socket], "placement"))
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    expected = direct.stdout.replace("new_zeros on the device cpu", "new_zeros on the device cuda")
    expected = expected.replace("trunc_normal_ cpu", "trunc_normal_ cuda")
    assert proxied.stdout == expected


def test_out_arguments_an_operation_resizes_take_the_shape_it_gave_them(server: ProxyServer) -> None:
    """`out=` tensors of another shape (empty ones, tuples of them, arguments not named `out`)
    come back with the result's shape and storage size, the second call of a signature too."""
    direct, proxied = outputs_on_cpu_and_device("probe_out_arguments.py", server)
    assert "add 1 (3, 3) (3, 1) True 36" in direct and "max (3,) (3,)" in direct
    assert proxied == direct


def test_a_tensor_given_other_data_stands_for_it_from_then_on(server: ProxyServer) -> None:
    """`.data =` on parameters, plain tensors and views: shapes, values and training as directly."""
    direct, proxied = outputs_on_cpu_and_device("probe_data_assignment.py", server)
    assert "parameter (4,) 4.0 [1.0, 1.0, 1.0, 1.0]" in direct and "view [7.0, 7.0" in direct
    assert proxied == direct


def test_generators_made_for_the_device_draw_as_the_direct_run_draws(server: ProxyServer) -> None:
    direct, proxied = outputs_on_cpu_and_device("probe_generators.py", server)
    assert "device True True True" in direct and "replay True 5" in direct and "pickle True True" in direct
    assert proxied == direct


def test_device_default_generators_stand_for_the_generator_the_device_draws_with(server: ProxyServer) -> None:
    """`torch.cuda.default_generators` was empty (RNG trackers index it); its generators report
    the CPU generator's state, replay it and draw with it."""
    direct, proxied = outputs_on_cpu_and_device("probe_default_generators.py", server)
    assert "device True True 3\nreplay True\n" in direct
    assert proxied == direct


def test_packed_sequences_keep_their_batch_sizes_and_lengths_on_the_host(server: ProxyServer) -> None:
    """RNNs over packed sequences: batch sizes and lengths on the host, as CUDA returns them (the
    LSTM refused batch sizes on the device), values, gradients and errors as directly."""
    direct, proxied = outputs_on_cpu_and_device("probe_packed_sequences.py", server)
    assert "packed cpu [3, 3, 2, 2, 1]" in direct and "padded (3, 5, 4) cpu [5, 2, 4]" in direct
    assert proxied == direct


def test_views_made_in_inference_mode_are_normal_tensors_as_directly(server: ProxyServer) -> None:
    """Every view of a normal tensor under `torch.inference_mode()` failed ("Cannot set
    version_counter for inference tensor"): its stand-in was made as an inference tensor."""
    direct, proxied = outputs_on_cpu_and_device("probe_inference_mode.py", server)
    assert "t [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]] False" in direct and "made [[1.0, 2.0, 3.0]" in direct
    assert proxied == direct


def test_transformer_inference_takes_the_fused_fast_paths_as_directly(server: ProxyServer) -> None:
    """Eval-mode encoder layers and attention run torch's fused kernels on the CPU and on GPUs; on a
    device they took the slow path (the device mode counts as an override), so bits differed. An
    encoder given a padding mask runs them on a nested tensor and gives zeros where it pads."""
    direct, proxied = outputs_on_cpu_and_device("probe_fast_paths.py", server)
    assert direct.count("\n") == 13 and "encoder padded inference mode" in direct
    assert proxied == direct


def test_views_of_a_storage_resized_smaller_are_refused_not_run(server: ProxyServer) -> None:
    """An operation on a view of a storage the job resized to 0 crashed the job's proxy server
    (SIGSEGV: the kernels do not check bounds); it is refused with torch's bounds message."""
    result = run_program(["probe_shrunk_storage.py"], proxy_env([server.socket], "shrunk"))
    assert result.returncode == 0, result.stderr
    needs = "storage offset 4, and itemsize 4 requiring a storage size of 48"
    bounds = f"{needs} are out of bounds for storage of size 0"
    for name in ("add", "fill", "copy", "read"):
        assert f"{name} proxy: sizes [2, 4], strides [4, 1], {bounds}\n" in result.stdout
    assert "sum proxy: sizes [12], strides [1], storage offset 0," in result.stdout
    assert result.stdout.endswith("storage 0\nregrown 16.0 torch.Size([12])\n")


def test_deterministic_mode_takes_the_cpus_kernels_for_padding_upsampling_and_pooling(
    server: ProxyServer,
) -> None:
    """Under `use_deterministic_algorithms(True)` torch sends CUDA tensors to Python decompositions:
    replicate padding and 3-d pooling with indices failed on a device, upsampling gave other bits."""
    direct, proxied = outputs_on_cpu_and_device("probe_deterministic.py", server)
    assert direct.count("\n") == 11 and "max_pool3d (1, 2, 2, 3, 3)" in direct
    assert proxied == direct


def test_cross_entropy_with_class_weights_and_label_smoothing_as_directly(server: ProxyServer) -> None:
    """A weighted, label-smoothed mean summed its weights another way for a stand-in weight (a
    tensor subclass), so the input's gradient differed in the low bits."""
    direct, proxied = outputs_on_cpu_and_device("probe_cross_entropy.py", server)
    assert direct.count("\n") == 8 and "host weighted smoothed" in direct
    assert proxied == direct


def test_weight_averaging_averages_tensor_by_tensor_as_directly(server: ProxyServer) -> None:
    """`AveragedModel` averaged cuda tensors with foreach kernels (other bits than the host's
    tensor-by-tensor average), and with `use_buffers=True` failed on BatchNorm's integer counter."""
    direct, proxied = outputs_on_cpu_and_device("probe_weight_averaging.py", server)
    assert direct.count("\n") == 5 and "update_bn" in direct
    assert proxied == direct


def test_attention_with_only_gpu_kernels_allowed_runs_the_hosts_kernel(server: ProxyServer) -> None:
    """`sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)` (or flash and math switched off) failed with
    "No viable backend" on a device, where a GPU runs it: the host's default kernel runs instead."""
    direct, proxied = outputs_on_cpu_and_device("probe_attention_backends.py", server)
    assert direct.count("\n") == 5 and direct.endswith("flags back True True\n")
    assert proxied == direct


def test_the_default_dtype_is_the_programs_on_the_device(server: ProxyServer) -> None:
    """After `torch.set_default_dtype(torch.float64)` integers divided, factories and layers on a
    device gave float32 (the server ran with its own default), `torch.full` float32 values in a
    float64 tensor; switching back reused results planned under the other default."""
    direct, proxied = outputs_on_cpu_and_device("probe_default_dtype.py", server)
    assert direct.count("\n") == 48 and "int / 3 torch.float64 ['0.3333333333333333'" in direct
    assert proxied == direct
    # the server went back to its own default: another process's operations are float32 ones
    check = "import torch; x = torch.arange(3, device='cuda') / 3; print(x.dtype, x.sum().item())"
    after = run_program(["-c", check], proxy_env([server.socket], "after-float64"))
    assert after.stdout == "torch.float32 1.0\n", after.stderr


def test_torch_func_transforms_mix_their_inputs_with_other_device_tensors(server: ProxyServer) -> None:
    """`vmap` with `in_dims=None`, `grad` over a function using a captured device tensor,
    per-sample gradients of a module with a buffer and a MAML step failed with "cuda:0 and cpu":
    the device check took the transforms' wrappers of stand-ins for host tensors."""
    direct, proxied = outputs_on_cpu_and_device("probe_functorch_closures.py", server)
    assert direct.count("\n") == 8 and direct.startswith("vmap captured ['0.0', '2.0', '6.0'")
    assert proxied == direct


def test_histc_counts_integers_on_a_device_as_cuda_does(server: ProxyServer) -> None:
    """`torch.histc` of an int32 tensor (transformers' mixture-of-experts routing on a GPU) failed
    on a device: the host's kernel counts floating-point values only."""
    direct, proxied = outputs_on_cpu_and_device("probe_integer_histc.py", server)
    assert direct.count("\n") == 12 and "torch.int32 4 0 3 torch.int32 [2, 3, 1, 2]" in direct
    assert proxied == direct


def test_tensors_move_to_meta_and_parameters_rewrap_by_their_type(server: ProxyServer) -> None:
    """`x.to("meta")` of a device tensor gave a device tensor (accelerate's offload hooks never
    freed the weights they offloaded), and `type(param)(value, requires_grad=...)` (accelerate's
    `set_module_tensor_to_device`, behind `device_map` loading) raised TypeError."""
    direct, proxied = outputs_on_cpu_and_device("probe_meta_moves.py", server)
    assert direct.count("\n") == 8 and "loaded True True [[3.5, 2.5], [12.5, 11.5]]" in direct
    assert proxied == direct


def test_higher_order_operators_run_by_their_dense_implementation(server: ProxyServer) -> None:
    """flex_attention, `torch.cond`, `while_loop` and `map` on stand-ins failed with "There was no
    rule registered for HOP ... and subclass ProxyTensor"."""
    direct, proxied = outputs_on_cpu_and_device("probe_higher_order.py", server)
    assert direct.count("\n") == 6 and "while_loop 3 [0.0, 8.0, 16.0" in direct
    assert proxied == direct


def test_onednn_settings_are_the_programs_on_the_device(server: ProxyServer) -> None:
    """`torch.set_float32_matmul_precision("medium")` (bfloat16 products on the host), the
    precisions of `torch.backends.mkldnn` and `mkldnn.flags(enabled=False)` did not reach the
    server: a device computed every product and convolution in full float32 with oneDNN."""
    direct, proxied = outputs_on_cpu_and_device("probe_numeric_settings.py", server)
    lines = direct.splitlines()
    assert len(lines) == 6 and lines[0].split()[1:] != lines[1].split()[1:] != lines[4].split()[1:]
    assert proxied == direct


def test_foreach_operations_take_host_scalars_and_copy_between_host_and_device(server: ProxyServer) -> None:
    """`_foreach_addcdiv_(..., scalars)` with the scalars on the host, as CUDA's kernels want them,
    was refused as device mixing; a host tensor among the lists still is. `_foreach_copy_` between
    host and device lists (diffusers' EMA stored on the host) was refused too."""
    direct, proxied = outputs_on_cpu_and_device("probe_foreach_scalars.py", server)
    assert direct.count("\n") == 4
    assert proxied == direct


def test_torchscript_modules_run_load_onto_devices_and_refuse_saving_device_tensors(
    server: ProxyServer,
) -> None:
    """`torch.jit.save` of a module on a device wrote zeros (TorchScript reads tensor memory
    itself), and `torch.jit.load(f, map_location="cuda")` failed (its C++ has no CUDA here)."""
    result = run_program(["probe_torchscript.py"], proxy_env([server.socket], "torchscript"))
    assert result.returncode == 0, result.stderr
    refused = "proxy: TorchScript cannot save tensors of a proxied device"
    assert result.stdout.splitlines() == [
        "scripted cuda:0 [[6.5], [6.5]]",
        "traced cuda:0 torch.Size([1, 1])",
        "loaded cuda:0 cuda:0",
        f"jit.save {refused} (its serializer reads their memory itself): save a scripted host copy of "
        "the module, or its state_dict() with torch.save",
        f"save {refused} (its serializer reads their memory itself): save a scripted host copy of the "
        "module, or its state_dict() with torch.save",
    ]


def test_factories_take_device_scalars_as_values(server: ProxyServer) -> None:
    """`torch.full(..., fill_value=device_scalar, device="cuda")` (Hugging Face beam search) failed:
    the factory was sent to the server with the stand-in among its keywords."""
    direct, proxied = outputs_on_cpu_and_device("probe_factory_values.py", server)
    assert "full keyword True torch.int64 [[7, 7, 7], [7, 7, 7]]" in direct
    assert proxied == direct


def test_a_cuda_default_device_places_the_programs_tensors_there(server: ProxyServer) -> None:
    """`torch.set_default_device("cuda")` made every factory fail ("Could not run
    'aten::empty.memory_format' with arguments from the 'CUDA' backend"): torch applies the default
    beneath every other mode, after the device mode had let the call through."""
    direct, proxied = outputs_on_cpu_and_device("probe_default_device.py", server)
    assert "context device device device" in direct and "step 2 device" in direct
    assert proxied == direct


def test_operators_of_extension_libraries_run_by_their_cpu_kernels(server: ProxyServer) -> None:
    """Operators registered as C++ extensions register theirs (torchvision's nms, roi_align) were
    refused ("operators of the 'probe_extension' namespace are not served"): they run in the job
    on host copies, with their values, shapes, in-place updates and gradients as on the CPU."""
    direct, proxied = outputs_on_cpu_and_device("probe_extension_ops.py", server)
    assert "keep_above [0, 3] True" in direct and "grad [4.62" in direct
    assert proxied == direct


def test_custom_functions_get_zeros_on_the_device_for_unused_outputs(server: ProxyServer) -> None:
    """A custom autograd Function whose second output went unused failed in backward ("Expected all
    tensors to be on the same device"): the engine made its zero gradient on the host."""
    direct, proxied = outputs_on_cpu_and_device("probe_custom_functions.py", server)
    assert "backward gets True [0.0, 0.0]" in direct and "gradcheck True" in direct
    assert proxied == direct


def test_modules_move_and_load_weights_as_on_a_gpu(server: ProxyServer) -> None:
    """Every module conversion swapped parameters, so `load_state_dict` did too and failed where
    anything held a parameter (DDP's reducer, a live graph, a view: "Expected use_count"), the old
    `weight_norm` could not be moved, and `assign=True` trained other Parameters than on a GPU."""
    direct, proxied = outputs_on_cpu_and_device("probe_module_moves.py", server)
    assert "load while held True" in direct and "assign False [[0.0, 0.0, 0.0]" in direct
    assert "old weight_norm load True" in direct
    assert "tagged back True [[100.0, 100.0, 100.0]] [600.0, 300.0]" in direct
    assert proxied == direct


def test_tensors_made_from_lists_of_device_scalars_hold_their_values(server: ProxyServer) -> None:
    """`torch.tensor([loss_a, loss_b])` failed ("its data is not allocated yet"): torch read the
    stand-ins' empty host wrappers."""
    direct, proxied = outputs_on_cpu_and_device("probe_values_from_device.py", server)
    assert "tensor cpu torch.float32 [0.0, 5.0, 15.0]" in direct and "to device True 20.0" in direct
    assert proxied == direct


def test_conversions_put_tensors_where_the_program_asks(server: ProxyServer) -> None:
    """`Module.to("cpu")` left the parameters on the device, `x.to(y)` and `Module.to(y)` of a device
    tensor y went to the host (torch read y's C++ device), `type_as`, `view_as` and the like refused
    a host template, and sparse tensors reported an earlier tensor's number of elements."""
    direct, proxied = outputs_on_cpu_and_device("probe_conversions.py", server)
    assert "module to cpu ('cpu'" in direct and "b 1 (2, 1) (1,) [1.0] 2.0" in direct and "ERR" not in direct
    assert proxied == direct


def test_sparse_tensors_are_built_from_device_parts(server: ProxyServer) -> None:
    """Sparse embedding gradients and sparse tensors made from device parts were refused (the
    server serves no unchecked constructor), and a refused operator called again then failed
    with "plan N was not made" instead of the refusal."""
    direct, proxied = outputs_on_cpu_and_device("probe_sparse_parts.py", server)
    assert "embedding 2 True [[1, 2, 5]]" in direct and "csr [[0.0, 3.0], [4.0, 0.0]]" in direct
    refused = "PermissionError proxy: aten::_reshape_alias.default is n"
    assert proxied == direct + f"reshape_alias 0 {refused}\nreshape_alias 1 {refused}\n"


def test_a_model_split_over_two_devices_clips_and_steps_as_directly(tmp_path: Path) -> None:
    """clip_grad_norm_ and foreach and fused optimizers over parameters on two devices raised
    "Expected all tensors to be on the same device": torch grouped the stand-ins of both devices as
    one, by their C++ device (the host)."""
    servers = [start_server(tmp_path, f"dev{index}") for index in range(2)]
    try:
        direct = run_program(["split_model.py", "cpu"], base_env())
        env = proxy_env([s.socket for s in servers], "split")
        proxied = run_program(["split_model.py", "cuda"], env)
    finally:
        for s in servers:
            stop_server(s)
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    assert "step 5 loss" in direct.stdout
    assert proxied.stdout == direct.stdout


def test_a_callable_map_location_loads_tensors_where_it_sends_their_storages(tmp_path: Path) -> None:
    """`torch.load(f, map_location=lambda storage, loc: storage.cuda(gpu))` failed ("Storage device
    not recognized: cuda"): a host storage cannot become a device one here, so the callable is given
    one whose `.cuda()` and `.to("cuda")` name where its tensors go."""
    servers = [start_server(tmp_path, f"dev{index}") for index in range(2)]
    try:
        proxied = run_program(["probe_map_location.py"], proxy_env([s.socket for s in servers], "mapped"))
    finally:
        for s in servers:
            stop_server(s)
    assert proxied.returncode == 0, proxied.stderr
    assert proxied.stdout.splitlines() == [
        "cuda() ['cuda:0', 'cuda:0', 'cuda:0'] True 7",
        "cuda(1) ['cuda:1', 'cuda:1', 'cuda:1'] True 7",
        "to cuda:1 ['cuda:1', 'cuda:1', 'cuda:1'] True 7",
        "host ['cpu', 'cpu', 'cpu'] True 7",
        "cpu() ['cpu', 'cpu', 'cpu'] True 7",
        "as saved ['cuda:0', 'cuda:0', 'cpu'] True 7",  # where each was saved from
        "by torch ['cuda:1', 'cuda:1', 'cuda:1'] True 7",
        "loaded into a model cuda:0 True",
    ]


def test_warnings_inside_operations_are_shown_at_the_lines_a_direct_run_shows(server: ProxyServer) -> None:
    direct = run_program(["probe_warnings.py", "cpu"], base_env())
    proxied = run_program(["probe_warnings.py", "cuda"], proxy_env([server.socket], "warnings"))
    assert direct.returncode == 0 and proxied.returncode == 0, proxied.stderr[-3000:]

    def shown(stderr: str) -> list[str]:
        return [line for line in stderr.splitlines() if "Warning: " in line]

    assert len(shown(direct.stderr)) == 3 and "probe_warnings.py:16: UserWarning" in direct.stderr
    assert shown(proxied.stderr) == shown(direct.stderr)
    assert proxied.stdout == direct.stdout and "probe_warnings.py:21 UserWarning" in direct.stdout


def test_the_profiler_asked_for_cuda_activity_records_the_process_without_an_error_trace(
    server: ProxyServer,
) -> None:
    """torch.profiler with CUDA activity: this CPU build's fallback for CUDA events would print a
    C++ error trace; the profiler records the process's CPU activity, saying so once."""
    r = run_program(["profiled.py"], proxy_env([server.socket], "profiled"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["recorded True True 32768.0", "True"], r.stdout
    assert "Failed to record CUDA event" not in r.stderr and "frame #" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("the profiler records this process's CPU activity only") == 1, r.stderr


def test_device_tensors_format_and_share_memory_as_on_a_gpu(server: ProxyServer) -> None:
    """f"{loss:.4f}" of a 0-dim device tensor printed its number only on the host (TypeError on the
    device, and f"{loss}" the tensor's repr), and share_memory_() of a device tensor or module
    raised TypeError: both as on a GPU now (tests/programs/probe_format.py)."""
    direct, proxied = outputs_on_cpu_and_device("probe_format.py", server)
    assert proxied == direct
    assert "loss 0.1235 0.12345600128173828   1.23e-01|" in proxied


def test_functions_run_for_rpc_use_the_device(server: ProxyServer) -> None:
    """torch.distributed.rpc runs a remote call's function on a thread it starts in C++, where the
    device was unknown ("PyTorch is not linked with support for cuda devices" from `.to("cuda")`;
    pytorch/examples' rpc examples): tests/programs/rpc_device.py prints what it prints on the CPU."""
    direct, proxied = outputs_on_cpu_and_device("rpc_device.py", server)
    assert proxied == direct
    assert len(proxied.splitlines()) == 4 and all(" True " in line for line in proxied.splitlines())


def test_distributed_autograd_copies_gradients_to_the_device_from_many_threads(server: ProxyServer) -> None:
    """Distributed autograd runs the backward passes of concurrent RPC micro-batches on several
    threads at once, each copying a gradient to the device: those copies took the same tensor handle
    ("proxy: handle ... cannot take a new tensor", pytorch/examples' rpc/pipeline).
    tests/programs/rpc_pipeline.py prints every loss as on the CPU."""
    direct, proxied = outputs_on_cpu_and_device("rpc_pipeline.py", server)
    assert proxied == direct
    assert len(proxied.splitlines()) == 10


def test_utilization_is_the_share_of_the_last_second_the_device_worked(server: ProxyServer) -> None:
    """torch.cuda.utilization() answers as NVML's does (it raised pynvml's error): most of the last
    second while the program keeps the device busy, 0 after a second and a half of rest."""
    r = run_program(["utilization.py"], proxy_env([server.socket], "utilization"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["busy True int", "idle 0"]


def test_other_processes_meet_the_device_as_on_a_gpu(server: ProxyServer) -> None:
    """Fork, spawn and pickle with device tensors (tests/programs/other_processes.py): a forked
    child gets torch's error instead of its parent's connection (which hung it), a device tensor
    sent to a spawned process is refused instead of arriving as a host copy, a CPU copy arrives,
    a spawned child uses the device its parent uses (it was refused: one session per rank), and
    a pickled device tensor or module unpickles onto the device (it came back on the host)."""
    proxied = run_program(["other_processes.py"], proxy_env([server.socket], "processes"))
    assert proxied.returncode == 0, proxied.stderr
    assert proxied.stdout.splitlines() == [
        "forked child: Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
        "you must use the 'spawn' start method",
        "parent after the fork: 8.0",
        "spawn with a device tensor: proxy: a CUDA tensor cannot be sent to another process on "
        "proxied devices (CUDA IPC is not served): send a CPU copy (tensor.cpu()) or create the "
        "tensor in that process",
        "spawned child got: cpu 4.0",
        "spawned child on the device: used it: 2.0",
        "pickled: cuda:0 12.0",
        "pickled layer: a parameter on cuda:0, torch.bfloat16, True, True",
    ]


def test_torch_moves_device_tensors_to_the_host_where_the_program_keeps_state(server: ProxyServer) -> None:
    """`.to("cpu")` called by torch's own code kept the stand-in: gradients of host parameters were
    left unclipped and unscaled, an average kept on the host never moved, `PackedSequence.cpu()`
    stayed on the device; RNN lengths on the device ended in a RecursionError, not CUDA's refusal."""
    direct, proxied = outputs_on_cpu_and_device("probe_host_moves_by_torch.py", server)
    *direct_lines, direct_last = direct.splitlines()
    *proxied_lines, proxied_last = proxied.splitlines()
    assert len(direct_lines) == 8 and "average 2 [1.8286256790161133, " in direct
    assert "packed cpu False" in direct
    assert proxied_lines == direct_lines
    assert direct_last == "lengths on cpu accepted"
    refusal = "'lengths' argument should be a 1D CPU int64 tensor, but got 1D cuda:0 Long tensor"
    assert proxied_last == f"lengths on cuda refused: {refusal}"


def test_a_program_sees_only_its_own_threads(server: ProxyServer) -> None:
    """The channel's reader thread showed in `threading.enumerate()` and `active_count()`."""
    direct, proxied = outputs_on_cpu_and_device("probe_own_threads.py", server)
    assert "before 1 [('MainThread', False)]" in direct and "worker sum 2.0" in direct
    assert proxied == direct


def test_a_host_tensor_mixed_into_a_modules_call_is_refused_as_cuda_refuses_it(server: ProxyServer) -> None:
    """A host input to a device module, or a host target to a loss, ran silently (the check left
    out every call torch's own code makes), and `torch.cat`/`stack` of a list mixing the two were
    never checked (tests/programs/probe_mixed_devices.py)."""
    r = run_program(["probe_mixed_devices.py"], proxy_env([server.socket], "mixed"))
    assert r.returncode == 0, r.stderr
    refused = [
        "linear",
        "conv",
        "embedding",
        "layer_norm",
        "batch_norm",
        "cross_entropy",
        "mse_loss",
        "cat",
        "stack",
    ]
    taken = ["index with host indices", "0-dim host scalar", "copy_ from the host", "module on its device"]
    assert r.stdout.splitlines() == [f"{n} refused" for n in refused] + [f"{n} taken" for n in taken]
