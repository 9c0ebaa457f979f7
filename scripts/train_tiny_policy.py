"""Train the shipped tiny GLM-5.2-architecture policy (`glm52_jax/assets/tiny_policy`) by short SFT.

A randomly initialised `config.tiny()` model never writes a correct `Answer: N` line, so every GRPO
group of the launcher's embedded default scores all -1. This script fine-tunes the tiny model on the
75 bundled math rows so that its completions end in `Answer: N` and are right *part* of the time.

Data: every (row, N) pair for N in {--prompt_tokens (default 256 = the max `min_prompt_tokens` over
the bundled rows, 241, rounded up to a multiple of 32), --prompt_tokens + --extra_length (default
+64)}: prompt = `build_exact_prompt(tok, row, N)`, target completion (--target answer, default) =

    "\nAnswer: <ground_truth>" + <|endoftext|>

or (--target worked) "\n<extra_info.check> = <ground_truth>\nAnswer: <ground_truth>" + <|endoftext|>.
The default is answer-only: the reward reads only the Answer line, and a 600k-parameter model does
not memorise the 75 worked expressions within the time budget (tried: loss still 1.4 nats/token after
150 steps). Both lengths share one padded buffer shape, so one compiled step serves both.

Loss: mean next-token cross-entropy over completion tokens only; full-parameter AdamW in float32,
plus an indexer-alignment loss (--indexer_aux, see `hidden_states_with_indexer_aux`): the DSA
indexer gets no gradient from the LM loss, and with its random init (index_topk 32 of ~300 keys) the
model stays stuck at the marginal answer distribution for a long time; teaching each full layer's
indexer to select the problem-statement and completion keys for the completion queries makes it
learn as fast as dense attention (20-row test, 80 steps: mean P(exact) 0.30 with it, 0.05 without,
0.28 with index_topk=512 at 3x the step time). That loss moves indexer parameters only. The
architecture is exactly `tiny()`.

Stopping: the loss pass also yields, per sequence, the probability of sampling the exact target
completion at T=1 (`exp(sum log p)`). Training stops at the first step where the mean of each pair's
latest value reaches --stop_exact_prob (default 0.3), or at --steps; this keeps the policy right only
part of the time, so GRPO groups get mixed rewards. Everything is seeded: a rerun with the same
software gives the same checkpoint.

Final evaluation (printed and written to TRAINING.md): greedy correctness per row, T=1.0 sampled
accuracy (--eval_samples per row, max_new_tokens 32) and the fraction of G=2 groups with mixed
rewards, at N (and N + extra_length with --eval_all_lengths). Rewards are
`compute_score(tok.decode(completion, skip_special_tokens=True), ground_truth)`.

Usage: python scripts/train_tiny_policy.py [--out glm52_jax/assets/tiny_policy] [--seed 0] ...
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from glm52_jax import positions as rope_lib
from glm52_jax.checkpoint.hf import load_pretrained, save_pretrained
from glm52_jax.config import tiny
from glm52_jax.dapo_data import load_rows
from glm52_jax.model.indexer import block_scores
from glm52_jax.model.layers import project
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa, target_logprobs
from glm52_jax.rl.prompts import QUESTION_SEPARATOR, build_exact_prompt, layout_exact_prompt, min_prompt_tokens
from glm52_jax.rl.rewards.dapo import compute_score
from glm52_jax.rollout.sampler import Sampler, SamplingParams
from glm52_jax.rollout.tokenizer import Tokenizer

DEFAULT_OUT = os.path.join("glm52_jax", "assets", "tiny_policy")
EOS_ID = 1  # <|endoftext|>
PAD_ID = 6  # <|pad|>


def target_text(row) -> str:
    check, gt = row.extra_info.get("check"), row.ground_truth
    return f"\n{check} = {gt}\nAnswer: {gt}" if check else f"\nAnswer: {gt}"


def target_ids(tok: Tokenizer, row, max_tokens: int, kind: str = "worked") -> list[int]:
    ids = tok.encode(target_text(row)) + [EOS_ID]
    if kind == "answer" or len(ids) > max_tokens:
        ids = tok.encode(f"\nAnswer: {row.ground_truth}") + [EOS_ID]
    return ids


def build_data(tok: Tokenizer, rows, lengths, max_target: int, target_kind: str):
    """All (row, prompt length) pairs packed into one buffer shape, so one compiled step serves every
    length: ids [P, max(lengths) + max_target] (prompt, completion, then right padding; padding after a
    sequence cannot affect it under causal attention), start [P] (index of the hidden state that predicts
    the first completion token = n - 1), targets / mask [P, max_target]."""
    width = max(lengths) + max_target
    pairs = [(i, n) for n in lengths for i in range(len(rows))]
    ids = np.full((len(pairs), width), PAD_ID, np.int32)
    start = np.zeros((len(pairs),), np.int32)
    targets = np.zeros((len(pairs), max_target), np.int32)
    mask = np.zeros((len(pairs), max_target), np.float32)
    key_target = np.zeros((len(pairs), max_target, width), np.float32)
    for p, (i, n) in enumerate(pairs):
        lay = layout_exact_prompt(tok, rows[i], n)
        prompt = lay.ids
        comp = target_ids(tok, rows[i], max_target, target_kind)
        lo, hi = problem_span(tok, rows[i], lay)
        for t in range(len(comp)):  # query n-1+t sees the problem and the completion ids n .. n-1+t
            key_target[p, t, lo:hi] = 1.0
            key_target[p, t, n:n + t] = 1.0
        ids[p, :n] = prompt
        ids[p, n:n + len(comp)] = comp
        start[p] = n - 1
        targets[p, :len(comp)] = comp
        mask[p, :len(comp)] = 1.0
    return pairs, (ids, start, targets, mask, key_target)


def problem_span(tok: Tokenizer, row, lay) -> tuple[int, int]:
    """Prompt positions [lo, hi) of the bare problem text (the question minus the DAPO wording);
    token boundaries are approximate (BPE may merge across the seams), which is fine for a target."""
    content, problem = row.content, row.problem
    k = content.find(problem)
    before = QUESTION_SEPARATOR + content[:k]
    after = content[k + len(problem):]
    lo = lay.question_start + len(tok.encode(before))
    hi = len(lay.ids) - len(tok.encode(after + tok.chat_template.turn_parts("user")[1]
                                       + tok.chat_template.generation_prompt))
    return lo, max(hi, lo + 1)


def hidden_states_with_indexer_aux(model: GlmMoeDsa, ids, qpos, key_target):
    """`model.hidden_states(ids)` computed layer by layer, plus an indexer-alignment loss.

    The DSA indexer gets no gradient from the LM loss (its top-k is not differentiable, and its
    inputs are stop_gradient'ed by design), so at random init each query's 32 selected keys are
    arbitrary. For every 'full' layer this adds a cross-entropy that teaches the indexer to rank the
    `key_target` keys (problem statement + completion so far) highest for the queries at `qpos`
    (the positions that predict completion tokens). The indexer's inputs are detached (as in
    DeepSeek-V3.2's indexer training), so this loss only moves indexer parameters and the LM loss
    never sees it. qpos: [B,T] int32; key_target: [B,T,S] float (0/1). Returns (h [B,S,D], aux).
    """
    cfg = model.cfg
    seq = ids.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)
    cos, sin = rope_lib.rope_cos_sin(positions, rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim))
    cos, sin = cos[None], sin[None]
    h = jnp.take(model.embed_tokens[...], ids, axis=0)
    topk = jnp.zeros((ids.shape[0], seq, min(cfg.index_topk, seq)), jnp.int32)
    causal = (jnp.arange(seq)[None, None, :] <= qpos[..., None])  # [B,T,S]
    target = key_target * causal
    target = target / jnp.maximum(target.sum(-1, keepdims=True), 1.0)
    n_queries = jnp.maximum(jnp.sum(jnp.any(target > 0, axis=-1)), 1)
    aux, n_full = 0.0, 0
    for seg, stack in zip(model.segments_plan, model.stacks):
        graphdef, state = nnx.split(stack)
        for rep in range(seg.repeats):
            unit = nnx.merge(graphdef, jax.tree.map(lambda x, rep=rep: x[rep], state))
            for kind, layer in zip(unit.kinds, unit.layers):
                attn = layer.self_attn
                if kind[1] == "full" and attn.indexer is not None:
                    x = jax.lax.stop_gradient(layer.input_layernorm(h))
                    q_resid = attn.q_a_layernorm(project(x, attn.q_a_proj, "bsd,dq->bsq"))
                    iq, ik, iw = attn.indexer.project(x, jax.lax.stop_gradient(q_resid), cos, sin)
                    iq = jnp.take_along_axis(iq, qpos[:, :, None, None], axis=1)  # [B,T,H,I]
                    iw = jnp.take_along_axis(iw, qpos[:, :, None], axis=1)  # [B,T,H]
                    scores = block_scores(iq, iw, ik, cfg.index_head_dim ** -0.5)  # [B,T,S]
                    logp = jax.nn.log_softmax(jnp.where(causal, scores, -1e30), axis=-1)
                    aux = aux - jnp.sum(target * logp) / n_queries
                    n_full += 1
                h, topk, _ = layer(h, cos, sin, positions, topk)
    return model.norm(h), aux / max(n_full, 1)


def make_loss(graphdef, aux_weight: float = 0.0):
    def loss_fn(params, rest, ids, start, targets, mask, key_target):
        model = nnx.merge(graphdef, params, rest)
        pos = start[:, None] + jnp.arange(targets.shape[1])[None]  # [B, T]
        if aux_weight:
            h, aux = hidden_states_with_indexer_aux(model, ids, pos, key_target)
        else:
            h, aux = model.hidden_states(ids), jnp.zeros(())
        h = jnp.take_along_axis(h, pos[..., None], axis=1)  # [B, T, D]
        lp = target_logprobs(model, h, targets) * mask  # [B, T]
        loss = -jnp.sum(lp) / jnp.sum(mask)
        exact = jnp.exp(jnp.sum(lp, axis=-1))  # P(sampling exactly the target) at T=1
        return loss + aux_weight * aux, (loss, aux, exact)

    return loss_fn


def evaluate(model, tok: Tokenizer, rows, n_prompt: int, *, samples: int, max_new: int, seed: int):
    """Greedy correctness and T=1.0 sampled rewards per row at prompt length n_prompt."""
    sampler = Sampler(model, chunk_size=1024, prefix_cache_bytes=0)
    stop = tuple(model.cfg.eos_token_id)
    greedy, sampled, n_answer = [], [], 0
    examples = []
    for i, row in enumerate(rows):
        prompt = build_exact_prompt(tok, row, n_prompt)
        res = sampler.sample(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0, num_samples=1,
                                                    seed=seed, stop_token_ids=stop))
        text = tok.decode(res.completion(0), skip_special_tokens=True)
        greedy.append(compute_score(text, row.ground_truth)["score"] > 0)
        if i < 3:
            examples.append((row.ground_truth, text))
        res = sampler.sample(prompt, SamplingParams(max_new_tokens=max_new, temperature=1.0, num_samples=samples,
                                                    seed=seed + 1 + i, stop_token_ids=stop))
        scores = []
        for g in range(samples):
            text = tok.decode(res.completion(g), skip_special_tokens=True)
            n_answer += "Answer:" in text
            scores.append(compute_score(text, row.ground_truth)["score"])
        sampled.append(scores)
    sampled = np.asarray(sampled)  # [R, samples] of +-1
    correct = sampled > 0
    pairs = [(a, b) for a in range(samples) for b in range(a + 1, samples)]
    mixed_emp = float(np.mean([correct[:, a] != correct[:, b] for a, b in pairs])) if pairs else float("nan")
    p = correct.mean(1)
    return dict(greedy_acc=float(np.mean(greedy)), greedy=greedy, sampled_acc=float(correct.mean()),
                answer_frac=n_answer / sampled.size, mixed_g2=mixed_emp,
                mixed_g2_expected=float(np.mean(2 * p * (1 - p))), per_row=p, examples=examples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=800, help="max optimizer steps")
    ap.add_argument("--prompt_tokens", type=int, default=256, help="launcher prompt length N")
    ap.add_argument("--extra_length", type=int, default=64, help="also train at N + this (0: only N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=10, help="sequences per step")
    ap.add_argument("--max_target_tokens", type=int, default=12,
                    help="completion buffer; worked lines longer than this fall back to the Answer line")
    ap.add_argument("--stop_exact_prob", type=float, default=0.3,
                    help="stop when the mean over pairs of P(exact target at T=1) reaches this (<=0: never)")
    ap.add_argument("--eval_samples", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=32)
    ap.add_argument("--target", choices=("worked", "answer"), default="answer",
                    help="completion: worked line + Answer line, or the Answer line only")
    ap.add_argument("--indexer_aux", type=float, default=1.0,
                    help="weight of the indexer-alignment loss (0: off; it only trains indexer parameters)")
    ap.add_argument("--index_topk", type=int, default=0, help="override tiny()'s index_topk (0: keep 32)")
    ap.add_argument("--train_rows", type=int, default=0,
                    help="train on the first K rows only (0: all; for experiments)")
    ap.add_argument("--eval_rows", type=int, default=0, help="evaluate on the first K training rows (0: all, <0: skip)")
    ap.add_argument("--eval_all_lengths", action="store_true", help="also evaluate at N + extra_length")
    ap.add_argument("--log_every", type=int, default=20)
    args = ap.parse_args(argv)
    t_start = time.time()

    tok = Tokenizer.default()
    rows = load_rows()
    need = max(min_prompt_tokens(tok, r) for r in rows)
    lengths = [args.prompt_tokens] + ([args.prompt_tokens + args.extra_length] if args.extra_length else [])
    if args.prompt_tokens < need:
        ap.error(f"--prompt_tokens {args.prompt_tokens} < max min_prompt_tokens {need}")
    print(f"rows={len(rows)} max min_prompt_tokens={need} prompt lengths={lengths}", flush=True)

    overrides = {"index_topk": args.index_topk} if args.index_topk else {}
    cfg = tiny(**overrides)
    # Run-time options only (not stored in the checkpoint): one indexer / attention block per
    # sequence is faster on CPU at these lengths.
    width = max(lengths) + args.max_target_tokens
    opts = ModelOptions(param_dtype=jnp.float32, remat=False, indexer_query_block=width, indexer_key_block=width,
                        attention_query_block=width)
    model = GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"params={n_params} config overrides={overrides or 'none'}", flush=True)

    train_rows = rows[:args.train_rows] if args.train_rows else rows
    pairs, data = build_data(tok, train_rows, lengths, args.max_target_tokens, args.target)
    sched = optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup), optax.constant_schedule(args.lr)],
                                 [args.warmup])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.98,
                                                                  weight_decay=args.weight_decay))
    opt_state = tx.init(params)
    loss_fn = make_loss(graphdef, args.indexer_aux)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, rest, batch):
        (_, (loss, aux, exact)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux, exact

    # Fixed minibatch schedule: each epoch visits every (row, length) pair once, shuffled by --seed;
    # a short last batch is topped up from the next permutation so every step has one shape.
    rng = np.random.default_rng(args.seed)
    queue: list[int] = []
    exact_last = np.full((len(pairs),), np.nan)  # latest P(exact target) of each pair (before its update)
    step_i, loss_v, mean_exact = 0, float("nan"), float("nan")
    stopped = "max steps"
    while step_i < args.steps:
        while len(queue) < args.batch:
            queue.extend(rng.permutation(len(pairs)).tolist())
        idx, queue = np.asarray(queue[:args.batch]), queue[args.batch:]
        batch = tuple(jnp.asarray(x[idx]) for x in data)
        params, opt_state, loss, aux, exact = train_step(params, opt_state, rest, batch)
        step_i += 1
        loss_v = float(loss)
        exact_last[idx] = np.asarray(exact)
        mean_exact = float(np.mean(exact_last)) if not np.isnan(exact_last).any() else float("nan")
        if step_i % args.log_every == 0 or step_i == 1:
            print(f"step {step_i:4d} loss {loss_v:.4f} indexer aux {float(aux):.3f} mean P(exact) {mean_exact:.3f} "
                  f"[{time.time() - t_start:.0f}s]", flush=True)
        if args.stop_exact_prob > 0 and mean_exact >= args.stop_exact_prob:
            stopped = f"mean P(exact) {mean_exact:.3f} >= {args.stop_exact_prob}"
            break
    print(f"stopped at step {step_i} ({stopped}); last loss {loss_v:.4f}", flush=True)

    # Final loss over all pairs (no update), per prompt length.
    eval_loss = jax.jit(make_loss(graphdef))
    final = {}
    for n in lengths:
        sel = np.asarray([p for p, (_, m) in enumerate(pairs) if m == n])
        nll, ntok, exacts = 0.0, 0.0, []
        for c in range(0, len(sel), args.batch):
            chunk = sel[c:c + args.batch]
            real = len(chunk)
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], args.batch - real)])
            batch = [np.asarray(x[chunk]) for x in data]
            batch[3][real:] = 0.0  # padding copies count for nothing
            _, (batch_nll, _, e) = eval_loss(params, rest, *(jnp.asarray(x) for x in batch))
            nll += float(batch_nll) * batch[3].sum()
            ntok += batch[3].sum()
            exacts.extend(np.asarray(e)[:real].tolist())
        final[n] = (nll / ntok, float(np.mean(exacts)))
        print(f"final len {n}: loss {final[n][0]:.4f} mean P(exact target) {final[n][1]:.3f}", flush=True)
    train_s = time.time() - t_start

    model = nnx.merge(graphdef, params, rest)
    save_pretrained(model, args.out)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"saved {args.out} ({size / 1e6:.2f} MB)", flush=True)

    # Evaluate the checkpoint as shipped (round trip through load_pretrained).
    loaded = load_pretrained(args.out, dtype=jnp.float32)
    evals = {}
    eval_rows = train_rows[:args.eval_rows] if args.eval_rows else train_rows
    eval_lengths = lengths if args.eval_all_lengths else lengths[:1]
    for n in (eval_lengths if args.eval_rows >= 0 else []):
        ev = evaluate(loaded, tok, eval_rows, n, samples=args.eval_samples, max_new=args.max_new_tokens, seed=args.seed)
        evals[n] = ev
        print(f"eval len {n}: greedy acc {ev['greedy_acc']:.3f} | T=1.0 acc {ev['sampled_acc']:.3f} "
              f"({args.eval_samples}/row) | 'Answer:' in {ev['answer_frac']:.2f} | mixed G=2 groups "
              f"{ev['mixed_g2']:.3f} (expected {ev['mixed_g2_expected']:.3f})", flush=True)
        print("  greedy per row: " + "".join("1" if g else "0" for g in ev["greedy"]), flush=True)
        print("  T=1 per row   : " + " ".join(f"{p:.2f}" for p in ev["per_row"]), flush=True)
        for gt, text in ev["examples"]:
            print(f"  e.g. gt={gt}: {text!r}", flush=True)
    wall = time.time() - t_start
    print(f"wall time {wall:.0f}s (training {train_s:.0f}s)", flush=True)

    cmd = "python scripts/train_tiny_policy.py" + ("" if argv is None and len(sys.argv) == 1
                                                    else " " + " ".join(sys.argv[1:] if argv is None else argv))
    lines = [
        "# tiny_policy: SFT of `glm52_jax.config.tiny()` on the 75 bundled math rows",
        f"- Command: `{cmd}` (seed {args.seed}, AdamW lr {args.lr}, batch {args.batch}, float32, indexer-alignment "
        f"aux weight {args.indexer_aux}); wall {wall:.0f}s on a shared 2-core CPU. "
        f"Config overrides: {overrides or 'none'}.",
        f"- Steps: {step_i} (stop rule: {stopped}). Prompt lengths (build_exact_prompt): {lengths}; target = "
        + ("`\\nAnswer: <answer><|endoftext|>`." if args.target == "answer"
           else "`\\n<check> = <answer>\\nAnswer: <answer><|endoftext|>`."),
        "- Final loss (completion tokens): " + ", ".join(f"N={n}: {final[n][0]:.4f}" for n in lengths) + ".",
    ]
    for n, ev in evals.items():
        lines.append(f"- Eval N={n}: greedy acc {ev['greedy_acc']:.3f}; T=1.0 acc {ev['sampled_acc']:.3f} "
                     f"({args.eval_samples} samples/row, max_new_tokens {args.max_new_tokens}); "
                     f"mixed G=2 groups {ev['mixed_g2']:.3f}; 'Answer:' in {ev['answer_frac']:.2f} of samples.")
    lines.append("- Rewards: `compute_score(tok.decode(completion, skip_special_tokens=True), ground_truth)`.")
    with open(os.path.join(args.out, "TRAINING.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
