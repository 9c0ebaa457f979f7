"""Deviceless compilation for NVIDIA GPUs on a CPU-only machine (sm_90a: H20, H200).

With the `gpu-aot` extra installed (the CUDA 12 PJRT plugin and nvcc's pip wheel), XLA compiles a
program for a GPU topology described by a `GpuTargetConfigProto` (`targets/*.txtpb`) without any GPU:
Pallas kernels go through Triton and ptxas for real, so a kernel that needs more shared memory than
the target has fails here exactly as it would on the device.

    compiled = compile_for_gpu(fn, jax.ShapeDtypeStruct(...), ..., target="h20")
    compiled.memory          # argument / output / temp bytes per device
    compiled.kernels         # {kernel name: KernelResources(shared_memory, registers, spill_bytes, ...)}

The XLA options this needs (ptxas / libdevice location, no device query for sorts, a dump for the
per-kernel figures) are passed per compile, so it runs in any process whose default backend is the CPU
(`JAX_PLATFORMS=cpu`, as the tests run). Targets: "h200" is XLA's own config; "h20" is derived from
it by hand (78 SMs, 96 GB; its rates are estimates, its shared memory per block is the sm_90 limit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax

from glm52_jax import kernels

TARGETS = {"h200": "h200.txtpb", "h20": "h20_approx.txtpb"}
_TARGET_DIR = Path(__file__).parent / "targets"
SHARED_MEMORY_MESSAGES = ("Shared memory size limit exceeded", "exceeds available shared memory")


class SharedMemoryError(RuntimeError):
    """A kernel needs more shared memory per block than the target offers (XLA's / ptxas' message)."""


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One GPU kernel of a compiled program, as XLA launches it and ptxas reports it."""

    grid: tuple[int, ...]
    threads: tuple[int, ...]
    shared_memory: int  # bytes per block (Triton's dynamic shared memory included)
    registers: int | None  # per thread (ptxas -v); None when ptxas could not be run on the dumped PTX
    spill_bytes: int | None  # spill stores + loads per thread
    # The tensor-core instructions its PTX uses (e.g. "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"):
    # whether a dot became Hopper's wgmma, and on which operand types.
    mma: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GpuCompiled:
    compiled: object  # jax.stages.Compiled (for the GPU; it cannot run here)
    memory: dict  # per-device bytes: argument, output, alias, temp
    kernels: dict  # kernel name -> KernelResources (Pallas kernels carry their `name=`)
    target: str


def missing() -> str | None:
    """What is missing for deviceless compiles (None when they can run)."""
    needed = (("jax_plugins.xla_cuda12", "jax-cuda12-plugin"), ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12"))
    for module, package in needed:
        if not installed(module):
            return f"{package} is not installed (pip install -e '.[gpu-aot]')"
    if not (nvcc_dir() / "bin" / "ptxas").exists():
        return f"ptxas not found under {nvcc_dir()}"
    return None


def installed(module: str) -> bool:
    """Whether dotted `module` can be imported; False (not ModuleNotFoundError) when its parent package is
    missing too, as `jax_plugins` and `nvidia` are on the light install (`pip install -e .`)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def nvcc_dir() -> Path:
    """The pip CUDA compiler wheel's directory (bin/ptxas, nvvm/libdevice)."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if installed("nvidia.cuda_nvcc") else None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-cuda-nvcc-cu12 is not installed (pip install -e '.[gpu-aot]')")
    return Path(next(iter(spec.submodule_search_locations)))


def target_config(target: str) -> str:
    """The `GpuTargetConfigProto` text of a target name in TARGETS."""
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; known: {sorted(TARGETS)}")
    return (_TARGET_DIR / TARGETS[target]).read_text()


@functools.cache
def topology(target: str, hosts_by_gpus: str = "1x1x1"):
    """The deviceless topology of a target: "1x1x1" one GPU, "4x1x8" four hosts of eight."""
    from jax.experimental import topologies

    reason = missing()
    if reason:
        raise RuntimeError(f"deviceless GPU compilation unavailable: {reason}")
    return topologies.get_topology_desc("", platform="cuda", topology=hosts_by_gpus,
                                        target_config=target_config(target))


def gpu_mesh(target: str, hosts_by_gpus: str = "1x1x1", axis_names: tuple[str, ...] = ("x",)):
    """A mesh over the topology's devices (one axis unless `axis_names` says otherwise; sizes multiply out)."""
    from jax.experimental import topologies

    topo = topology(target, hosts_by_gpus)
    shape = (len(topo.devices),) + (1,) * (len(axis_names) - 1)
    return topologies.make_mesh(topo, shape, axis_names)


def compile_for_gpu(fn, *abstract_args, target: str = "h200", mesh=None, static_argnums=(),
                    options: dict | None = None) -> GpuCompiled:
    """Compiles `fn(*abstract_args)` (ShapeDtypeStructs, pytrees allowed) for one GPU of `target`.

    Arguments without a sharding are replicated on `mesh` (default: a one-GPU mesh of the target); `options`:
    more XLA compile options (e.g. `{"xla_gpu_enable_triton_gemm": False}` to see the cuBLAS path).
    Raises SharedMemoryError with XLA's message when a kernel's block needs more shared memory
    than the target has. The per-kernel registers come from running ptxas -v on the PTX XLA dumps.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = gpu_mesh(target) if mesh is None else mesh

    def place(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
        return x

    args = jax.tree.map(place, abstract_args)
    with tempfile.TemporaryDirectory(prefix="glm52_gpu_aot_") as dump, deviceless_lowering(target):
        options = {**compiler_options(), **(options or {}), "xla_dump_to": dump, "xla_gpu_dump_llvmir": True,
                   "xla_dump_emitter_re": ".*"}
        try:
            with jax.set_mesh(mesh):
                compiled = jax.jit(fn, static_argnums=static_argnums).lower(*args).compile(compiler_options=options)
        except Exception as err:  # XLA raises JaxRuntimeError; Mosaic GPU a ValueError
            message = str(err)
            if any(m in message for m in SHARED_MEMORY_MESSAGES):
                raise SharedMemoryError(f"{target}: {message.strip()}") from err
            raise
        kernels = _kernel_resources(Path(dump))
    stats = compiled.memory_analysis()
    memory = {k: getattr(stats, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    return GpuCompiled(compiled, memory, kernels, target)


def compiler_options() -> dict:
    """XLA options every deviceless GPU compile needs: the pip wheel's ptxas / libdevice, and no
    device query for CUB's sort scratch size (sorts use XLA's fallback kernel)."""
    return {"xla_gpu_cuda_data_dir": str(nvcc_dir()), "xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}


def device_memory_bytes(target: str) -> int:
    """The target config's `device_memory_size` (bytes of HBM per GPU)."""
    return int(re.search(r"device_memory_size: (\d+)", target_config(target)).group(1))


@contextlib.contextmanager
def deviceless_lowering(target: str):
    """Lowering settings for a compile with no GPU present.

    Pallas' Triton backend looks the compute capability up by device kind; "NVIDIA H20" is not in
    its table and its fallback asks the (absent) concrete device, so H20 maps to sm_90 here (a
    real H20 reports its own). The program is traced as a GPU program (`kernels.targets_gpu()`).
    Compiled programs are kept out of the persistent compilation cache: they are compiled to be
    inspected, never run here, and a cache hit would skip the dump.
    """
    from jax._src.pallas.triton import gpu_info  # private: guarded, the attribute may move

    original = getattr(gpu_info, "_get_device_arch_name", None)
    if original is not None:
        def arch_name(kind: str) -> str:
            return "9.0" if kind.startswith("NVIDIA H20") and not kind.startswith("NVIDIA H200") else original(kind)
        gpu_info._get_device_arch_name = arch_name
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        with kernels.lowering_for_gpu():  # kernels="auto" picks Pallas, and Pallas calls compile (no interpreter)
            yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
        if original is not None:
            gpu_info._get_device_arch_name = original


_THUNK_RE = re.compile(r"\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes")


def _kernel_resources(dump: Path) -> dict:
    """{kernel: KernelResources} from XLA's thunk sequence (launch shape, shared memory) and ptxas -v."""
    registers, mma = {}, {}
    for ptx in sorted(dump.glob("*.ptx")):
        registers.update(ptxas_usage(ptx.read_text()))
        mma.update(mma_instructions(ptx.read_text()))
    kernels = {}
    for thunks in sorted(dump.glob("*thunk_sequence.txt")):
        for name, grid, threads, smem in _THUNK_RE.findall(thunks.read_text()):
            regs, spills = registers.get(name, (None, None))
            # Keyed without the plan's byte annotation (`kernels.traffic_name`): "sparse_mla_forward", ...
            key = re.sub(r"(_flops\d+)?_bytes\d+", "", name)
            kernels[key] = KernelResources(tuple(int(v) for v in grid.split(",")),
                                           tuple(int(v) for v in threads.split(",")), int(smem), regs, spills,
                                           mma.get(name, ()))
    return kernels


_ENTRY_RE = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_MMA_RE = re.compile(r"\b((?:wgmma\.mma_async|mma\.sync)[\w.]*)")


def mma_instructions(ptx: str) -> dict:
    """{function: sorted distinct MMA instructions} of a PTX module's kernels (`.entry` functions)."""
    entries = list(_ENTRY_RE.finditer(ptx))
    found = {}
    for n, entry in enumerate(entries):
        body = ptx[entry.end(): entries[n + 1].start() if n + 1 < len(entries) else len(ptx)]
        found[entry.group(1)] = tuple(sorted(set(_MMA_RE.findall(body))))
    return found


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> dict:
    """{function: (registers per thread, spill bytes)} from `ptxas -v` on a PTX module.

    XLA may emit a newer PTX ISA version than the pip ptxas accepts; the module is then retried
    with the version ptxas names (the instructions sm_90a kernels use exist in both).
    """
    ptxas = str(nvcc_dir() / "bin" / "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "module.ptx"
        for _ in range(2):
            src.write_text(ptx)
            run = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", os.devnull],
                                 capture_output=True, text=True, check=False)
            supported = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", run.stderr)
            if run.returncode == 0 or supported is None:
                break
            ptx = re.sub(r"^\.version [\d.]+", f".version {supported.group(1)}", ptx, count=1, flags=re.M)
    usage, name, spills = {}, None, 0
    for line in run.stderr.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = int(m.group(1)) + int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and name is not None:
            usage[name] = (int(m.group(1)), spills)
            name, spills = None, 0
    return usage
