"""Every run setting with its default and meaning: the base that configs/*.py override.

The defaults are the embedded laptop run (configs/tiny.py): one online GRPO transaction of the
project's tiny GLM-5.2 policy on CPU. A config file is `get_config()` plus a few overrides, and any
key can be set on the command line: `--config.train.steps=3`. The config is locked, so a key that is
not listed here is an error (`--config.trian.steps` names `train.steps`). `run_config.RunSpec`
validates every value before anything is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_collections

from glm52_jax import choices


def from_file(path: str | Path) -> ml_collections.ConfigDict:
    """`get_config()` of a config file (what `--config=PATH` loads): for configs built on another one
    (configs/rehearsal.py and configs/2m_one_node.py start from configs/2m.py)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"glm52_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "online_grpo_tiny"  # names the default workdir runs/<name>_<UTC time> and the receipts
    c.seed = 0  # model init (checkpoint="random"), LoRA init and the run's sampling RNG
    c.mesh = ""  # "" = one device; "folded=32" (CP and EP on one axis, the seed's), "context=4,expert=2"

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = "embedded"  # "embedded" (the shipped tiny policy), "random" (seeded init), or an HF dir
    c.model.preset = "tiny"  # architecture for checkpoint="random", and for plan mode without a checkpoint
    c.model.dtype = "float32"  # base weights and activations: float32 or bfloat16
    c.model.base_weights = "stored"  # base on device: stored (as the checkpoint) | fp8 (e4m3, 128x128 block scales)
    c.model.rope_scaling_json = ""  # a YaRN payload file; "" = $GLM52_ROPE_SCALING_JSON if set, else native
    c.model.tokenizer = ""  # tokenizer.json or its dir; "" = the checkpoint's, else the project's tiny one
    c.model.kernels = "auto"  # DSA + expert grouped-matmul kernels: auto (Pallas on GPU, else jnp), reference, pallas
    # Expert-parallel token exchange: auto (ragged_all_to_all on GPU, else dense), dense (fixed capacity), ragged
    c.model.moe_transport = "auto"
    c.model.moe_token_block = 1024  # tokens a device routes per expert-parallel exchange (buffers scale with it)
    # The ragged exchange's receive buffer, in multiples of the rows a device sends per round (tokens x top-k; the
    # average it receives when routing is balanced). Rows beyond it go in further passes: nothing is dropped.
    # 0 = the worst case (every device's rows to one: N x), one pass but N x the work on the received rows.
    c.model.moe_receive_capacity = 0.0
    # Windows each pass's exchange is split into: 2 = one window's all-to-all in flight while the other's experts
    # compute (pays where the exchange is slow: across hosts); 1 = one synchronous exchange per pass (each window
    # re-reads the local experts' weights and launches its own kernels: cheaper where the exchange is fast).
    c.model.moe_exchange_windows = 2
    # Devices of the expert axis that share a node (consecutive on the axis; the dense transport): > 0 sends each
    # token across the network once to every other node, then to its experts over NVLink; 0 = one exchange.
    c.model.moe_node_devices = 0
    # How XLA:GPU runs that exchange when it spans hosts (parallel/xla_options.py): "xla" = its multi-host
    # decomposer (supported; all-gathers each round's send rows across hosts: 4x the bytes on 4 hosts), "nccl" =
    # one ragged all-to-all of the exact rows by NCCL send/recv (XLA's fallback; unverified on hardware here).
    c.model.moe_cross_host = "xla"
    c.model.lora_rank = 8  # LoRA rank r
    c.model.lora_alpha = 16.0  # LoRA scale = alpha / rank
    c.model.lora_families = choices.LORA_FAMILIES  # adapted weight families (attention, experts, ...)
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as --mode=export writes) or a
    # Megatron LoRA state dict file (Megatron-Bridge names; .safetensors, or a torch file read with
    # weights_only=True) whose adapters seed step 1 instead of fresh ones; its rank, families and shapes (and a PEFT
    # adapter's alpha) must match the lora_* keys; a Megatron file's scale is lora_alpha / lora_rank.
    # "" = fresh adapters (A random, B zero). A resumed run restores its checkpoint instead.
    c.model.init_adapter = ""
    # Frozen base weights on a mesh: "fsdp" shards each non-expert weight over all devices (1/N each) and the layer
    # scan all-gathers one layer's weights just before use (forward, decode, gradients); "replicated" keeps a whole
    # copy per device (the routed experts are expert-sharded either way). Same result; on one device the same thing.
    c.model.weight_sharding = "fsdp"
    # A call routing fewer tokens than this (decode steps, the response forward of a train step) keeps the FSDP-sharded
    # weight matrices in place and runs their projections tensor-parallel: activations move instead of weights.
    # 0 = always gather (the tiny configs: their weights are smaller than the activations' round trips).
    c.model.gather_weights_min_tokens = 0
    c.model.cache_dtype = "auto"  # decode/prefix cache latent + indexer key: auto (= model.dtype) or float8_e4m3fn
    c.model.indexer_dtype = "bf16"  # DSA indexer scoring: bf16 (the parameter dtype) or fp8 (e4m3 + per-row scales)
    # fp8 only: keep FP8's best N keys per query and pick the top-k of them rescored unquantized (0 = FP8's own top-k)
    c.model.indexer_candidates = 0
    # routed experts' matmuls: bf16 (the parameter dtype) or fp8 (w8a8: e4m3 rows per 128 and kernels per 128 x 128)
    c.model.expert_dtype = "bf16"

    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # DAPO-schema parquet/JSONL; "" = the 75 bundled rows
    c.data.dedupe = False  # drop repeated prompts (the public DAPO-Math-17k parquet repeats each ~100x)
    c.data.first_row = 0  # candidate i of the first transaction uses row (first_row + i) mod rows
    c.data.prompt_tokens = 256  # exact prompt length N in tokens (filler keeps every prompt at exactly N)

    c.sampling = ml_collections.ConfigDict()
    c.sampling.num_samples = 2  # G samples per prompt (the GRPO group)
    # Samples each request draws (all rewarded and recorded); the update's G are chosen from them by the rule in
    # rl/group.py. 0 = num_samples (the group is the request's samples). Otherwise >= num_samples.
    c.sampling.samples_per_request = 0
    c.sampling.max_new_tokens = 32  # response length cap R
    c.sampling.temperature = 1.0  # > 0; old log-probs are taken at this temperature
    c.sampling.top_p = 1.0  # nucleus truncation, in (0, 1]; 1 = off
    c.sampling.top_k = 0  # top-k truncation; 0 = off
    c.sampling.chunk_size = 128  # prefill chunk (tokens) for chunked prefill and prefix-cache reuse
    c.sampling.prefill_mode = "chunked"  # chunked | whole (one context-parallel forward of a cold prompt)
    # Per-device budget of the sampler's prompt-KV cache (a prompt sharing a prefix with a cached one reuses it).
    c.sampling.prefix_cache_mib_per_device = 256

    c.search = ml_collections.ConfigDict()
    c.search.max_candidates = 8  # prompts tried per transaction until a group's rewards differ
    # Engine probe: before the candidates, one request of this many prompt tokens (exact-N prompt of the
    # transaction's first row) is sampled and recorded in the receipt; 0 = off. Must be < data.prompt_tokens.
    c.search.probe_tokens = 0

    c.reward = ml_collections.ConfigDict()  # the DAPO rule reward of every sample (rl/rewards/dapo.py: verl math_dapo)
    # True: verl >= 0.9.1's rule, which scores the last \boxed{} (verbatim, in the last 100 characters) when no
    # "Answer:" line parses. False: the rule before it (verl 0.5.0-0.9.0), which the seed's runs used.
    c.reward.boxed_fallback = False

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1  # transactions; each commits a receipt, then an Orbax checkpoint (resumable)
    c.train.gradient_mode = "response_only"  # conventional | response_only (seed's) | shared_prefix (exact)
    c.train.learning_rate = 1e-4  # AdamW learning rate, > 0
    c.train.weight_decay = 0.0  # AdamW decoupled weight decay, >= 0
    c.train.max_grad_norm = 1.0  # global-norm gradient clip before AdamW, > 0
    c.train.clip_ratio_low = 0.2  # PPO ratio clip below 1, in (0, 1)
    c.train.clip_ratio_high = 0.28  # PPO ratio clip above 1 (DAPO clip-higher), in (0, 1)
    c.train.loss_agg_mode = "token-mean"  # verl loss aggregation (token-mean, seq-mean-token-sum, ...)

    c.checkpoint = ml_collections.ConfigDict()  # Orbax checkpoints of a train run (WORKDIR/checkpoints)
    c.checkpoint.keep = 3  # newest step checkpoints kept, >= 1 (older ones are deleted; their receipts stay)

    c.parity = ml_collections.ConfigDict()  # --mode=parity: gradient modes compared on one rollout group
    c.parity.modes = choices.GRADIENT_MODES  # modes to run
    c.parity.reference = "conventional"  # the mode the others are compared with
    # Pass/fail per compared mode and case: "MODE: METRIC OP VALUE, ..." with metrics cosine (>=), rel_l2 (<=) of the
    # LoRA gradients (global, or one family as "unembed.rel_l2"), logprob_abs (<=, max over response tokens) and
    # loss_abs (<=). Defaults for the float32 tiny policy: shared_prefix is exact. response_only drops the gradient
    # through the prompt: the seed measured 1.2% relative L2 at 32K (configs/32k_parity.py bounds it globally), but at
    # 256 prompt tokens the prompt path carries half the gradient (measured 0.51-0.53), so only the unembed family,
    # which that path does not reach, and the forward values are bounded.
    c.parity.acceptance = (
        "shared_prefix: cosine >= 0.99999, rel_l2 <= 1e-5, logprob_abs <= 1e-5, loss_abs <= 1e-6",
        "response_only: unembed.cosine >= 0.99999, unembed.rel_l2 <= 1e-5, logprob_abs <= 1e-5, loss_abs <= 1e-5",
    )
    # Parity starts from a nonzero LoRA (a fresh one has B = 0, so every A-gradient would be zero): the adapter of
    # model.init_adapter when set, else fresh A plus B drawn N(0, lora_b_std^2) from the run's seed.
    c.parity.lora_b_std = 0.02
    c.parity.outliers = 10  # the largest relative per-parameter differences listed per mode pair
    c.parity.torch_reference = False  # also compute conventional/response_only in PyTorch (HF + PEFT; extra `parity`)
    c.parity.megatron_reference = False  # ... and in megatron-core (GPTModel + Megatron-Bridge LoRA; extra `parity`)

    c.plan = ml_collections.ConfigDict()  # --mode=plan: AOT compile for the mesh, no weights
    # Programs to compile: every program of a transaction (also: forward, a reference). The probe's two are
    # skipped when search.probe_tokens = 0, prefill_tail (later candidates after a prefix-cache hit) in chunked
    # prefill mode (it is `prefill` there).
    c.plan.programs = ("prefill", "prefill_tail", "decode", "train", "new_logprobs", "inventory", "probe_prefill",
                       "probe_decode")
    c.plan.hbm_gib = 96.0  # per-device memory the programs must fit with plan.target=cpu (H20: 96 GiB)
    # Where the programs compile: "cpu" = virtual CPU devices (XLA:CPU, runs anywhere); "h20" / "h200" = XLA's GPU
    # compiler, deviceless (needs the gpu-aot extra), topology HOSTSx1x8 (1x1xN up to 8 GPUs), fits against the
    # target's memory x XLA_PYTHON_CLIENT_MEM_FRACTION (0.90, which the launcher sets), plus a per-kernel time
    # estimate per program and of the first candidate (optimistic / central / pessimistic).
    c.plan.target = "cpu"
    # The efficiency table the time estimate divides by: "" = the packaged one (glm52_jax/plan/efficiency_table.json);
    # a path = one a calibration run wrote (scripts/gpu_check.sh on a lent GPU: python -m glm52_jax.plan.calibrate).
    c.plan.efficiency_table = ""

    c.export = ml_collections.ConfigDict()  # --mode=export: PEFT adapter + merged HF checkpoint
    # The merged checkpoint's config.json keeps the run's position extension (e.g. the 2M YaRN payload) instead of
    # the base checkpoint's native positions. Off by default, as in the seed: the payload is a reversible run-time
    # override, not part of the released model.
    c.export.keep_rope_scaling = False
    c.export.merged_fp8 = False  # FP8 base: merged/ re-quantized as the base (e4m3 + block scales), not in model.dtype

    # A deadline per phase (load, prefill, decode, update, checkpoint save/restore, export, parity modes, barriers):
    # a phase past it stops the run with one line naming it and the processes not finished, every process's Python
    # stacks in WORKDIR/watchdog/ (parallel/watchdog.py). May change on a rerun.
    c.watchdog = ml_collections.ConfigDict()
    # Seconds a phase may last (each phase's first call includes its compile), > 0; 0 = no watchdog. An hour covers
    # the tiny CPU runs many times over; a 2M run takes its deadlines from a plan (below) or sets more.
    c.watchdog.phase_timeout_s = 3600.0
    # With WORKDIR/plan.json of a GPU target on the run's mesh (--mode=plan --workdir=WORKDIR): the prefill, decode
    # and update deadlines are this x (the programs' calibrated pessimistic time x calls + compile) + 60 s; 0 = no plan.
    c.watchdog.plan_factor = 3.0
    return c


def glm52_release(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The settings the seed's GLM-5.2 runs share (configs/2m.py, configs/32k_parity.py)."""
    c.model.checkpoint = "/ckpt/GLM-5.2"  # the BF16 HF release directory (override per machine)
    c.model.preset = "glm52"  # plan mode's architecture when the checkpoint is not on this machine
    c.model.dtype = "bfloat16"
    c.data.dedupe = True
    c.sampling.max_new_tokens = 16
    c.train.learning_rate = 1e-5
    c.plan.target = "h20"  # the seed's GPUs: plan with XLA's GPU compiler (--config.plan.target=cpu without it)
    # A device routes 256 tokens per expert-parallel exchange: the receive buffer is sized for the worst case
    # (every device's pairs to one device: 32 x 256 x 8 rows of 6144), so the block bounds it.
    c.model.moe_token_block = 256
    # ... and receive 2 x the rows sent (4,096 of 6144, 50 MB) instead of the worst case's 65,536 (805 MB): every
    # op on the received rows (sort, expert matmuls, LoRA, casts, the return) shrinks 16x; a round whose busiest
    # device gets more than 2x the average takes a second pass (dropless).
    c.model.moe_receive_capacity = 2.0
    # The exchange as plain all_to_alls of 128-row chunks per destination (2 x the average), across hosts too. Planned
    # on 4x8 H20 (benchmarks/RESULTS.md), whole-prompt prefill: 2,187 GB across hosts per device, against 4,120 GB for
    # the ragged exchange through XLA's multi-host decomposer (it all-gathers every round's send rows across hosts)
    # and 1,220 GB for the exact ragged rows over NCCL send/recv (moe_cross_host=nccl, XLA's fallback, unverified on
    # hardware).
    # A round whose fullest (source, destination) chunk exceeds 128 rows takes more passes: unmeasured on real routing.
    c.model.moe_transport = "dense"
    # Gather a layer's weights or keep them in place (tensor-parallel projections), from bytes per device on 32 H20s
    # (bf16 weights, float32 activations): the gather of an MoE layer's non-expert matrices receives ~418 MB; kept in
    # place, the same layer moves ~516 KB per token (each projection's output, all-gathered, or its partial sums,
    # all-reduced at 2x), so a forward breaks even near 810 tokens, and a rematerialised train step (the forward twice
    # plus the backward's activation moves against two gathers) near 540. 512 keeps the decode steps (8 rows), the
    # response forwards (16-128 tokens) in place and gathers for every prefill chunk (16K, or the whole prompt).
    c.model.gather_weights_min_tokens = 512
    return c
