"""The XLA options a run chooses (`parallel.xla_options`): names, spelling in XLA_FLAGS, precedence."""

import pytest

from glm52_jax import choices
from glm52_jax.parallel import xla_options


def test_every_choice_has_its_options():
    assert set(xla_options.CROSS_HOST_OPTIONS) == set(choices.MOE_CROSS_HOST)
    assert xla_options.cross_host_options("xla") == {}
    nccl = xla_options.cross_host_options("nccl")
    assert nccl == {"xla_gpu_unsupported_enable_ragged_all_to_all_multi_host_decomposer": False,
                    "xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": True}
    with pytest.raises(ValueError, match="moe_cross_host: expected one of"):
        xla_options.cross_host_options("mpi")


def test_export_appends_and_keeps_what_the_caller_set():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                        "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=false"}
    xla_options.export_to_environ(xla_options.cross_host_options("nccl"), env)
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=false",  # the caller's own value stays
        "--xla_gpu_unsupported_enable_ragged_all_to_all_multi_host_decomposer=false"]
    empty: dict[str, str] = {}
    xla_options.export_to_environ({}, empty)
    assert empty == {}
