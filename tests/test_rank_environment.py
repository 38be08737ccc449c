"""The environment the daemon gives each rank: pure, milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from singularityd.jobs import launch
from singularityd.jobs.launch import WITHOUT_AMX, cpu_has_amx, rank_environments


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    """A /proc/cpuinfo of two CPUs with these flags."""
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text("".join(f"processor\t: {n}\nflags\t\t: {flags}\n\n" for n in range(2)))
    return path


def two_ranks(user_env: dict[str, str]) -> list[dict[str, str]]:
    """The environments of a 2-rank job submitted with `user_env`."""
    return rank_environments(
        user_env, job_id=3, user="nobody", ranks=2, devices=(0,), device_env={}, master_port=29500
    )


def test_amx_is_found_by_its_tile_flag(tmp_path: Path) -> None:
    assert cpu_has_amx(cpuinfo(tmp_path, "fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"))
    assert not cpu_has_amx(cpuinfo(tmp_path, "fpu sse2 avx512f avx512_bf16"))
    assert not cpu_has_amx(tmp_path / "missing")


@pytest.mark.parametrize("amx", [True, False])
def test_ranks_get_onednn_and_mkl_capped_below_amx_only_on_a_cpu_with_amx_and_the_user_may_override(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    monkeypatch.setattr(launch, "cpu_has_amx", lambda: amx)
    for env in two_ranks({}):
        assert {key: env.get(key) for key in WITHOUT_AMX} == (
            WITHOUT_AMX if amx else dict.fromkeys(WITHOUT_AMX)
        )
    for env in two_ranks({"ONEDNN_MAX_CPU_ISA": "AVX2"}):
        assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_ranks_get_every_variable_torchrun_gives_a_worker_of_one_node() -> None:
    """What torchrun's local agent sets for each worker (torch.distributed.elastic), as one node's
    role "default" with the ranks making their own store."""
    for rank, env in enumerate(two_ranks({})):
        assert {key: env[key] for key in env if key.startswith(("ROLE_", "GROUP_", "TORCHELASTIC_"))} == {
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "TORCHELASTIC_RUN_ID": "sing-3",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )


def test_ranks_of_a_job_of_several_get_one_thread_as_torchrun_gives_its_workers() -> None:
    """torchrun sets OMP_NUM_THREADS=1 for each worker when it starts more than one, unless set;
    a host reduction's bits depend on it."""
    assert [env["OMP_NUM_THREADS"] for env in two_ranks({})] == ["1", "1"]
    assert [env["OMP_NUM_THREADS"] for env in two_ranks({"OMP_NUM_THREADS": "4"})] == ["4", "4"]
    (alone,) = rank_environments(
        {}, job_id=3, user="nobody", ranks=1, devices=(0,), device_env={}, master_port=1
    )
    assert "OMP_NUM_THREADS" not in alone


@pytest.mark.parametrize(("devices", "launched"), [((0, 1), False), ((0,), True), ((), True)])
def test_one_rank_on_several_devices_is_a_program_of_its_own_not_a_torchrun_worker(
    devices: tuple[int, ...], launched: bool
) -> None:
    """One process on several devices starts its own workers (mp.spawn, Lightning's launcher), as
    on a workstation: torchrun's variables would tell it its world is one process."""
    (env,) = rank_environments(
        {}, job_id=3, user="nobody", ranks=1, devices=devices, device_env={}, master_port=1
    )
    torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    assert (torchrun <= env.keys()) is launched and (torchrun & env.keys() == set()) is not launched
    assert env["SING_JOB_ID"] == "3"
