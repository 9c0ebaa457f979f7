"""Name scopes of the model's data-dependent loops (no JAX: plan mode's time estimate reads them).

A `lax.while_loop` / `fori_loop` whose trip count depends on data compiles to an HLO while op without a
known trip count; XLA keeps the name scope it was traced under in the op's name, and plan mode
(plan/loop_trips.py) gives each of these scopes the trip count the model's own block rules yield for the
program's shapes.
"""

CAUSAL_KEY_LOOP = "dsa_causal_key_loop"  # indexer.streaming_topk: the key blocks a query block can see
CACHED_KEY_LOOP = "dsa_cached_key_loop"  # indexer.cached_topk: the filled slots of a (shared) prompt cache
SUFFIX_KEY_LOOP = "dsa_suffix_key_loop"  # shared_cache: a sample's own suffix slots (+ its chunk)
PASS_LOOP = "moe_ep_pass_loop"  # expert_parallel._sum_of_passes: the exchange's passes (routing-dependent)
SCOPES = (CAUSAL_KEY_LOOP, CACHED_KEY_LOOP, SUFFIX_KEY_LOOP, PASS_LOOP)
