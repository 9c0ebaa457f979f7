"""Why our indexer top-k differs from HF's beyond L = index_topk on the bench model (diagnostic).

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.topk_ties [--seq_len 1024] [--out FILE]

Both models run the bench model's random weights (the checkpoint `benchmarks.run` section a
writes) in float32. For every 'full' indexer layer and every query whose selected key sets
differ, HF's index scores of that query are recomputed in float64 from HF's own inputs to the
indexer, and each swapped key (chosen by one side only) is placed relative to the k-th largest
score: `gap = |score - kth| / max|score|` over the row. A gap at float32 rounding level (~1e-6)
means a near-tie that either side may break either way (a different but equally valid top-k);
a large gap would be a bug. Exact ties (equal float64 scores, e.g. keys whose ReLU terms are all
zero) are counted separately.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile

import numpy as np


def hf_indexer_scores(mod, hidden_states, q_resid, position_embeddings, dtype):
    """HF `GlmMoeDsaIndexer`'s index scores recomputed from the same inputs, with its operations,
    in `dtype` (a torch dtype): [B,S,T], -inf above the diagonal."""
    import torch
    import torch.nn.functional as F
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    m = copy.deepcopy(mod).to(dtype)
    hs, qr = hidden_states.to(dtype), q_resid.to(dtype)
    cos, sin = (t.to(dtype) for t in position_embeddings)
    b, s, _ = hs.shape
    q = m.wq_b(qr).view(b, s, m.n_heads, m.head_dim)
    q_rot, q_pass = torch.split(q, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
    k = m.k_norm(m.wk(hs)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * m.softmax_scale)
    weights = m.weights_proj(hs) * (m.n_heads ** -0.5)
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return index.masked_fill(~causal, float("-inf"))


def run_hf(ckpt: str, ids: np.ndarray, lowest_index_ties: bool = False):
    """HF forward; per indexer layer its top-k (float32, as HF selects) and float64 scores.

    lowest_index_ties: select with a stable descending sort of HF's own float32 scores instead of
    `torch.topk`, i.e. break exact ties towards the lowest key index, as our streaming top-k does."""
    import torch
    import transformers
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    seen: dict[int, dict] = {}
    original = hf.GlmMoeDsaIndexer.forward

    def recording(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
        topk = original(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache)
        if lowest_index_ties:
            scores = hf_indexer_scores(self, hidden_states, q_resid, position_embeddings, torch.float32)
            stable = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : topk.shape[-1]]
            # Same sets as torch.topk wherever no exact tie straddles the k-th score.
            topk = stable.to(torch.int32)
        seen[self.layer_idx] = {"topk": topk[0].numpy(), "scores64": hf_indexer_scores(
            self, hidden_states, q_resid, position_embeddings, torch.float64)[0].numpy()}
        return topk

    hf.GlmMoeDsaIndexer.forward = recording
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(ids, dtype=torch.long), use_cache=False).logits[0].numpy()
    finally:
        hf.GlmMoeDsaIndexer.forward = original
    return logits, seen


def run_ours(ckpt: str, ids: np.ndarray):
    import jax
    import jax.numpy as jnp

    import glm52_jax

    jax.config.update("jax_default_matmul_precision", "highest")
    model = glm52_jax.load_pretrained(ckpt, dtype=jnp.float32)
    h, topk = model.hidden_states(jnp.asarray(ids), return_topk=True)
    return np.asarray(model.logits(h)[0]), {layer: np.asarray(t[0]) for layer, t in topk.items()}


def compare(hf_layers: dict, our_layers: dict, k: int) -> dict:
    """Per full layer: queries with different sets, and where the swapped keys sit (see module doc)."""
    out = {}
    for layer in sorted(our_layers):
        ours, theirs, s64 = our_layers[layer], hf_layers[layer]["topk"], hf_layers[layer]["scores64"]
        rows, gaps, exact, zero = [], [], 0, 0
        for q in range(ours.shape[0]):
            a = set(ours[q][ours[q] >= 0].tolist())
            b = set(theirs[q].tolist()) & set(range(q + 1))  # HF pads rows with < k causal keys by masked keys
            if a == b:
                continue
            row = s64[q, : q + 1]
            kth = np.sort(row)[::-1][min(k, q + 1) - 1]
            scale = np.max(np.abs(row))
            swapped = sorted(a ^ b)
            g = [abs(row[j] - kth) / scale for j in swapped]
            gaps += g
            exact += sum(row[j] == kth for j in swapped)
            zero += sum(row[j] == 0.0 for j in swapped)
            rows.append({"query": q, "ours_only": sorted(a - b), "hf_only": sorted(b - a),
                         "max_gap": max(g)})
        out[str(layer)] = {"queries": ours.shape[0], "queries_differing": len(rows),
                           "swapped_keys": len(gaps), "max_relative_gap": max(gaps) if gaps else None,
                           "exact_ties": int(exact), "zero_scores": int(zero), "examples": rows[:5]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument("--examples", type=int, default=3, help="differing queries listed per layer")
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    import glm52_jax
    from benchmarks.bench_model import _ids, bench_config, fast_model

    cfg = bench_config()
    with tempfile.TemporaryDirectory() as ckpt:
        # The checkpoint of benchmarks.run section a (task_checkpoint).
        model = fast_model(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), seed=1, weight_std=0.08,
                           norm_std=0.1, bias_std=0.1)
        glm52_jax.save_pretrained(model, ckpt)
        ids = _ids(args.seq_len, cfg.vocab_size)
        our_logits, our_layers = run_ours(ckpt, ids)
        res = {"seq_len": args.seq_len, "index_topk": cfg.index_topk}
        # As shipped (torch.topk), then with HF breaking exact ties like us.
        for name, lowest in (("hf_topk", False), ("hf_lowest_index_ties", True)):
            hf_logits, hf_layers = run_hf(ckpt, ids, lowest_index_ties=lowest)
            per_pos = np.max(np.abs(our_logits - hf_logits), axis=-1)
            layers = compare(hf_layers, our_layers, cfg.index_topk)
            for v in layers.values():
                v["examples"] = v["examples"][: args.examples]
            res[name] = {"layers": layers, "logits_max_abs_diff": float(per_pos.max()),
                         "positions_within_1e-4": float(np.mean(per_pos <= 1e-4)),
                         "first_position_over_1e-4": int(np.argmax(per_pos > 1e-4)) if (per_pos > 1e-4).any()
                         else None}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
