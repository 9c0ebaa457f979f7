"""One process of the two-process CPU test (run by test_distributed.py, not collected by pytest).

argv: mode (`sum` | `die` | `train OUT.npz` | `late SECONDS open|closed`). Env: GLM52_COORDINATOR /
GLM52_NUM_PROCESSES / GLM52_PROCESS_ID, XLA_FLAGS with 4 host devices. Prints one JSON line.

`sum` opens the mesh's communicators first (parallel/communicators.py) and reports how many groups it opened.
`late`: process 1 reaches the mesh's first reduction SECONDS after process 0, with the communicators opened
before (`open`) or not (`closed`); each process reports the sum or the first line of its error.

`train`: the tiny policy on the global context 4 x expert 2 mesh (each process owns 4 devices): a
sharded forward, then one GRPO update (shared_prefix gradients + AdamW); process 0 writes the
logits, log-probs, loss and the updated LoRA to OUT.npz. `training_problem` and `train_step` are
also what the test runs on one device for the reference.
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: lora_utils


def training_problem():
    """(model, batch): a 2-layer tiny policy with nonzero LoRA B, one prompt (45) and G=2 responses."""
    import jax.numpy as jnp
    from lora_utils import fast_rngs, with_random_b

    import glm52_jax
    from glm52_jax import config
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.model.transformer import GlmMoeDsa

    opts = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                                  attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0))
    cfg = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
    model = with_random_b(GlmMoeDsa(cfg, opts, rngs=fast_rngs()), seed=11)
    rng = np.random.default_rng(13)
    batch = dict(prompt=rng.integers(0, cfg.vocab_size, 45).astype(np.int32),
                 responses=rng.integers(0, cfg.vocab_size, (2, 6)).astype(np.int32),
                 response_mask=np.ones((2, 6), np.float32), advantages=np.array([1.0, -1.0], np.float32),
                 old_logprobs=rng.normal(-6.2, 0.3, (2, 6)).astype(np.float32))
    return model, batch


def train_step(model, batch) -> dict[str, np.ndarray]:
    """Forward logits of prompt+response 0, then one GRPO update; every result as host arrays."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.model.lora import LoRA
    from glm52_jax.parallel.placement import to_host
    from glm52_jax.rl.update import AdamWConfig, LoRAOptimizer, grpo_update

    ids = np.concatenate([batch["prompt"], batch["responses"][0]])[None]
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, jnp.asarray(ids))
    optimizer = LoRAOptimizer(model, AdamWConfig(learning_rate=1e-2, max_grad_norm=1.0))
    result = grpo_update(model, optimizer, **batch, mode="shared_prefix")
    lora = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    grads = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(result.grads)}
    out = dict(logits=logits, logprobs=result.logprobs, loss=result.loss, grad_norm=result.grad_norm,
               **{f"lora:{k}": v for k, v in lora.items()}, **{f"grad:{k}": v for k, v in grads.items()})
    return to_host(out)


def late(process: int, mesh, seconds: float, open_first: bool) -> None:
    """Process 1 starts the mesh's first all-device reduction `seconds` after process 0 (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm52_jax.parallel import communicators

    if open_first:
        communicators.open_all(mesh)
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P(("context", "expert"))),
                                     lambda idx: np.arange(8, dtype=np.float32)[idx])
    if process == 1:
        time.sleep(seconds)
    start = time.perf_counter()
    try:
        total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
        result = {"total": total}
    except Exception as e:  # noqa: BLE001 (XLA's error is what the test looks at)
        result = {"error": str(e).strip().splitlines()[0][:300]}
    print(json.dumps({"process": process, "waited": time.perf_counter() - start, **result}), flush=True)
    os._exit(0)  # the peer of a failed collective may never reach JAX's shutdown barrier


def main():
    mode = sys.argv[1]
    from glm52_jax.parallel import distributed

    group = distributed.initialize(heartbeat_s=int(os.environ.get("HEARTBEAT_S", "10")))
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm52_jax.parallel.mesh import parse_mesh

    if mode == "train":
        from glm52_jax.parallel.placement import place_model
        from glm52_jax.parallel.rules import axis_rules

        spec = parse_mesh("context=4,expert=2")
        mesh = spec.make()
        start = time.perf_counter()
        with axis_rules(spec.rules()):
            model, batch = training_problem()
            placed = place_model(model, mesh)
            with jax.set_mesh(mesh):
                out = train_step(placed, batch)
        if group.process_id == 0:
            np.savez(sys.argv[2], **out)
        print(json.dumps({"process": group.process_id, "devices": jax.device_count(),
                          "local_devices": jax.local_device_count(), "loss": float(out["loss"]),
                          "seconds": time.perf_counter() - start}), flush=True)
        return
    from glm52_jax.parallel import communicators

    mesh = parse_mesh("context=4,expert=2").make()
    if mode == "late":
        late(group.process_id, mesh, float(sys.argv[2]), sys.argv[3] == "open")
        return
    opened = communicators.open_all(mesh)
    data = np.arange(8 * 6 * 5, dtype=np.float32).reshape(8, 6, 5) / 7.0
    sharding = NamedSharding(mesh, P(("context", "expert")))
    x = jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx])
    if mode == "die" and group.process_id == 1:
        print(json.dumps({"process": 1, "died_at": time.time()}), flush=True)  # wall clock, for the survivor's bound
        os._exit(3)  # a crashed peer: no shutdown, no goodbye
    start = time.perf_counter()
    if mode == "die":
        time.sleep(2)  # let the peer go first
    total = jax.jit(lambda a: jnp.sum(jnp.tanh(a) * 3.0), out_shardings=NamedSharding(mesh, P()))(x)
    gram = jax.jit(lambda a: jnp.einsum("sij,skj->ik", a, a), out_shardings=NamedSharding(mesh, P()))(x)
    print(json.dumps({"process": group.process_id, "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(), "total": float(total), "opened": opened,
                      "compilation_cache": jax.config.jax_enable_compilation_cache,
                      "gram": np.asarray(gram).tolist(), "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
