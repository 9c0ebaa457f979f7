"""One process of the two-process CPU test (run by test_distributed.py, not collected by pytest).

argv: mode (`sum` | `die`). Env: GLM52_COORDINATOR / GLM52_NUM_PROCESSES / GLM52_PROCESS_ID,
XLA_FLAGS with 4 host devices. Prints one JSON line.
"""

import json
import os
import sys
import time

import numpy as np


def main():
    mode = sys.argv[1]
    from glm52_jax.parallel import distributed

    group = distributed.initialize(heartbeat_s=int(os.environ.get("HEARTBEAT_S", "10")))
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from glm52_jax.parallel.mesh import parse_mesh

    mesh = parse_mesh("context=4,expert=2").make()
    data = np.arange(8 * 6 * 5, dtype=np.float32).reshape(8, 6, 5) / 7.0
    sharding = NamedSharding(mesh, P(("context", "expert")))
    x = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])
    if mode == "die" and group.process_id == 1:
        os._exit(3)  # a crashed peer: no shutdown, no goodbye
    start = time.perf_counter()
    if mode == "die":
        time.sleep(2)  # let the peer go first
    total = jax.jit(lambda a: jnp.sum(jnp.tanh(a) * 3.0), out_shardings=NamedSharding(mesh, P()))(x)
    gram = jax.jit(lambda a: jnp.einsum("sij,skj->ik", a, a), out_shardings=NamedSharding(mesh, P()))(x)
    print(json.dumps({"process": group.process_id, "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(), "total": float(total),
                      "gram": np.asarray(gram).tolist(), "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
