"""megatron-core 0.19.2 on a CPU-only machine: every workaround the Megatron reference needs, in one place.

megatron-core is written for CUDA; its local (non-TransformerEngine) modules run on CPU once the few places that
ask for a GPU are answered. Each workaround below says what fails without it and why it changes nothing the model
computes. Measured on megatron-core 0.19.2 + torch 2.13 (CPU wheel build, no GPU, no TransformerEngine, no apex);
the recipe was first worked out in /work/shared/research/megatron/REPORT.txt.

    with cpu_runtime():                       # (1)-(3), (8), (9) for a build + forward + backward
        spec = local_dsa_block_spec(config)   # (4)
        model = GPTModel(config, spec, ...)

`CPU_CONFIG` holds the config settings that only make the model CPU-buildable ((5)-(7)); the model settings that
say what GLM-5 computes live in `megatron_policy.py`. The workarounds are numbered (1)-(9) where they are made.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# (5) transformer_impl="local": TransformerEngine does not install without CUDA; the local spec's modules are
#     plain torch (ColumnParallelLinear / RowParallelLinear / torch norms). use_cpu_initialization: parameters are
#     created on the CPU (else torch.cuda). The fusions are CUDA kernels; without them megatron runs the same
#     math in eager torch (apply_rope_fusion must be off for DSA anyway, transformer_config.py).
# (6) moe_token_dispatcher_type="allgather": the alltoall dispatcher creates a torch.cuda.Stream in __init__.
#     At expert-parallel size 1 both dispatchers only permute tokens to experts and back (no weights).
# (7) dsa_indexer_rotate_activation=False: the indexer's Hadamard rotation asserts bfloat16 input and calls the
#     CUDA-only fast_hadamard_transform (dsa.py `rotate_activation`). Megatron-Bridge's GLM5Bridge sets False as
#     well; an orthonormal rotation of both q and k leaves every index score unchanged (megatron_reference.py's
#     docstring, tests/torch_bridge/test_megatron_reference.py measures it).
CPU_CONFIG = dict(
    transformer_impl="local", use_cpu_initialization=True, apply_rope_fusion=False, bias_dropout_fusion=False,
    masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    moe_token_dispatcher_type="allgather", dsa_indexer_rotate_activation=False,
)


# (9) The notices megatron-core and torch print on a machine without TransformerEngine, apex or CUDA ("... not
#     installed. Falling back to ...", "No CUDA runtime is found", "GPTModel IS DEPRECATED", and the CUDA-graph
#     scope default's "full scope is deprecated") describe exactly the setup above; they are silenced while
#     megatron is imported, built and run, and nothing else is.
_NOTICES = (r".*(Transformer Engine and Apex are not installed|Apex is not installed|absl.logging is not installed"
            r"|full scope is deprecated)")
_NOISY_LOGGERS = ("megatron.core", "torch.utils.cpp_extension")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """(9) megatron's expected CPU-only notices silenced for the duration of the block."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOTICES)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _init_world() -> None:
    """(1) A torch.distributed world of one process and megatron's model-parallel groups at size 1.

    Megatron's modules ask parallel_state for their TP / PP / EP / CP groups even at size 1. gloo runs on CPU; a
    HashStore (in-process key-value store) needs no address or port, so concurrent runs never collide. Both are
    initialised once per process and kept: megatron keeps module-level references to the groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _init_rng_tracker() -> None:
    """(2) megatron's CUDA RNG tracker without CUDA.

    `tensor_parallel.model_parallel_cuda_manual_seed` reads torch.cuda's RNG state ("Found no NVIDIA driver"), and
    every forward enters `get_cuda_rng_tracker().fork()` around dropout. Dropout is 0 in the reference (no random
    number is drawn), so the tracker is created empty and its fork is a no-op context."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()


@contextlib.contextmanager
def cpu_runtime() -> Iterator[None]:
    """(1) and (2) once per process, (3), (8) and (9) for the duration of the block; restored on exit, so code
    outside the block sees torch as it was.

    (3) torch.cuda.current_device answers "cpu": several megatron modules put tensors on
    `torch.cuda.current_device()` whatever `use_cpu_initialization` says (the DSA indexer's RotaryEmbedding
    inv_freq, TopKRouter's expert_bias buffer, `TopKRouter.gating` moving its weight "to the GPU" on every forward).
    Only the device changes; the values are the same.
    (8) torch.compile off (`torch._dynamo.config.disable`): megatron wraps small helpers in torch.compile
    (megatron/core/jit.py `jit_fuser`, e.g. the MoE token (un)permutation); on CPU inductor builds C++ kernels for
    them with the system compiler, measured at ~10 s of a 0.8 s forward + backward. Run eagerly, the same functions
    compute the same values."""
    import torch
    import torch._dynamo

    with quiet():
        _init_world()
        _init_rng_tracker()
        current_device, dynamo_disabled = torch.cuda.current_device, torch._dynamo.config.disable
        if not torch.cuda.is_available():
            torch.cuda.current_device = lambda: "cpu"
        torch._dynamo.config.disable = True
        try:
            yield
        finally:
            torch.cuda.current_device, torch._dynamo.config.disable = current_device, dynamo_disabled


def local_dsa_block_spec(config):
    """(4) The GLM-5 (DSA) layer specs with megatron's local modules instead of TransformerEngine's.

    `get_transformer_block_with_experimental_attention_variant_spec` (what Megatron-Bridge's GLM5Bridge uses)
    asserts transformer_impl == "transformer_engine". Its per-layer helper takes a backend: `LocalSpecProvider`,
    given the `linear()` it lacks (megatron's own local stand-in for TELinear, post_training/modelopt/layers.py
    `Linear`, a torch.nn.Linear taking parallel_mode="duplicated"; used by the indexer's projections). The MLA
    down-projections go back to ColumnParallelLinear, the one non-TE class AbsorbedMLASelfAttention accepts for
    them (absorbed_mla.py: "Unsupported linear_q_down_proj"). At tensor-parallel size 1 every one of these is a
    plain `weight [out, in]` matmul, as TE's are. Returns the block's TransformerBlockSubmodules."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class LocalBackend(LocalSpecProvider):
        def linear(self):
            return Linear

    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=LocalBackend())
    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = ColumnParallelLinear
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalBackend().layer_norm(rms_norm=True))
