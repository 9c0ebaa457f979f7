"""The 2M run's rehearsal: configs/2m.py's structure at a size a laptop CPU runs in a minute.

    # 2 processes x 4 CPU devices (one 8-device mesh), as the 4 hosts x 8 GPUs of the real run:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu GLM52_COORDINATOR=127.0.0.1:12355 \\
        GLM52_NUM_PROCESSES=2 GLM52_PROCESS_ID=<0|1> \\
        python -m glm52_jax.launch --config=configs/rehearsal.py --workdir=/tmp/rehearsal
    # the other mesh rehearsed: --config.mesh=context=4,expert=2

Everything configs/2m.py sets is kept (whole-prompt prefill, response_only gradients, 8 samples per request
with an update group of G = 2, the engine probe, a per-device prefix-cache budget that keeps the prompt,
YaRN applied from a payload file, bf16 -> here float32 so a 2-process run can be compared with a 1-process
run to 1e-5); only the scale changes: the project's tiny policy, a YaRN payload of the 2M one's shape
(configs/rehearsal_yarn.json: factor 2.07 over 256 native positions -> 530 positions, as 2.0000153 x 1,048,576
-> 2,097,168), and an exact prompt of 530 - 16 = 514 tokens, so prompt + new tokens sit at the position limit
and the cache's 530 slots divide neither 8 devices nor 4 (the 2M run's 2,097,168 does not divide 32).
"""

from pathlib import Path

from glm52_jax import run_defaults

HERE = Path(__file__).resolve().parent


def get_config():
    c = run_defaults.from_file(HERE / "2m.py")
    c.name = "rehearsal_2m"
    c.mesh = "folded=8"  # the 2M run's folded axis, 8 wide; context=4,expert=2 is the other mesh rehearsed
    c.model.checkpoint = "embedded"  # the project's tiny GLM-5.2 policy (hidden 64, 6 layers, 8 experts)
    c.model.preset = "tiny"
    c.model.dtype = "float32"  # 1-process vs 2-process receipts compare to 1e-5
    c.model.rope_scaling_json = str(HERE / "rehearsal_yarn.json")
    c.data.path = ""  # the bundled rows
    c.sampling.max_new_tokens = 16  # as configs/2m.py (kept explicitly: the prompt length below depends on it)
    c.data.prompt_tokens = 338 - c.sampling.max_new_tokens  # at the position limit, as 2,097,152 + 16
    c.sampling.chunk_size = 64  # the probe's tail and a cached prompt's tail run in chunks, as at 2M
    c.sampling.prefix_cache_mib_per_device = 1  # a 514-token prompt's cache is ~0.1 MiB per device: kept
    c.search.probe_tokens = 256  # the engine probe before the exact-N requests (2M: 64K)
    c.train.learning_rate = 1e-4
    return c
