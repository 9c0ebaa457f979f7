"""XLA:CPU's gloo collectives build a communicator on a device set's FIRST collective, and give the other
processes 30 s to arrive: a process that reaches that first collective later fails the run (or, if only some
of a process's devices time out, leaves the rest waiting in the collective). Project-independent (jax only).

    python scripts/repro/gloo_first_use.py --skew 40            # process 0 fails after 30 s:
        Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out with key cpu:gloo/0,1,...
    python scripts/repro/gloo_first_use.py --skew 40 --warm     # a collective right after start-up, then the same
        40 s skew: the later collective waits for the late process and both finish (the communicator exists)
    python scripts/repro/gloo_first_use.py --skew 5             # under 30 s: both finish

Two processes x `--devices` CPU devices (gloo over localhost); process 1 sleeps `--skew` seconds before the first
collective over all devices (a compile that one process takes from the persistent cache and the other compiles is
such a skew: on this project's 2-core machine the parity programs compile in 100-330 s). XLA caches the
communicator per (ordered device list): later programs over the same devices reuse it, without the 30 s limit
(a collective itself waits up to XLA:CPU's 30 min collective timeout). Prints one line per process and exits 0
when both did what the flags predict.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _child(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.rank)
    mesh = Mesh(np.array(jax.devices()), ("x",))  # every device of both processes, one axis
    total = jax.jit(lambda a: jnp.sum(a), out_shardings=NamedSharding(mesh, PartitionSpec()))
    x = jax.make_array_from_callback((len(jax.devices()),), NamedSharding(mesh, PartitionSpec("x")),
                                     lambda index: np.ones((1,), np.float32))
    if args.warm:  # both processes are in step right after initialize: the communicator is built here
        jax.block_until_ready(total(x))
    if args.rank == 1:
        time.sleep(args.skew)
    start = time.monotonic()
    try:
        value = float(total(x + 1).addressable_data(0))
        print(f"process {args.rank}: sum {value} after waiting {time.monotonic() - start:.1f} s", flush=True)
    except Exception as e:  # noqa: BLE001 (the repro reports whatever XLA raises)
        print(f"process {args.rank}: failed after {time.monotonic() - start:.1f} s: {str(e).splitlines()[0][:200]}",
              flush=True)
        os._exit(1)  # skip jax's shutdown barrier (the peer may be waiting in the collective)
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skew", type=float, default=40.0, help="seconds process 1 arrives late")
    parser.add_argument("--warm", action="store_true", help="one collective over every device right after start-up")
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _child(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
    procs = [subprocess.Popen([sys.executable, __file__, f"--rank={r}", f"--coordinator=127.0.0.1:{port}",
                               f"--skew={args.skew}", f"--devices={args.devices}"] + (["--warm"] if args.warm else []),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]
    limit = args.skew + 120
    codes = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"(still waiting after {limit:.0f} s: killed)\n"
        print(out.strip())
        codes.append(p.returncode)
    expect_failure = args.skew > 30 and not args.warm
    print("as predicted" if (codes[0] != 0) == expect_failure else "NOT as predicted", f"(exit codes {codes})")
    return 0 if (codes[0] != 0) == expect_failure else 1


if __name__ == "__main__":
    sys.exit(main())
