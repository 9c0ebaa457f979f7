"""Raw sampler records: one JSON line per sample of every request, the receipt's `samples.jsonl`.

Each record (all deterministic: the same transaction writes the same bytes)::

    {"request": "candidate" | "probe", "candidate": i (None for the probe), "row": DAPO row index,
     "prompt_tokens": P, "prompt_sha256": sha256 of the prompt ids as little-endian int32 bytes,
     "seed": the request's sampling seed, "sample": j, "length": L (tokens generated, stop token included),
     "tokens": [L ids], "logprobs": [L old log-probs, float32 values as JSON numbers],
     "text": the decoded completion (special tokens skipped, as the reward reads it),
     "finish_reason": "stop" | "length"}

`prompt_sha256` equals the sha256 of `prompt_token_ids.npy`'s data (int32) for the accepted candidate.
Non-finite log-probs (never expected) are written as the strings "nan" / "inf" / "-inf", since the
evidence files are strict JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

REQUEST_CANDIDATE = "candidate"
REQUEST_PROBE = "probe"


def prompt_sha256(prompt: Sequence[int]) -> str:
    """sha256 of the prompt ids as little-endian int32 (the bytes `prompt_token_ids.npy` stores)."""
    return hashlib.sha256(np.asarray(prompt, dtype="<i4").tobytes()).hexdigest()


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def request_records(request: str, candidate: int | None, row: int, prompt: Sequence[int], seed: int, result,
                    texts: Sequence[str]) -> list[dict[str, Any]]:
    """One record per sample of a request. `result`: rollout.sampler.SampleResult (tokens [G,N],
    logprobs [G,N], lengths [G], finish_reasons [G]); `texts`: the G decoded completions."""
    digest = prompt_sha256(prompt)
    records = []
    for j, text in enumerate(texts):
        n = int(result.lengths[j])
        records.append({"request": request, "candidate": candidate, "row": row, "prompt_tokens": len(prompt),
                        "prompt_sha256": digest, "seed": seed, "sample": j, "length": n,
                        "tokens": [int(t) for t in result.tokens[j, :n]],
                        "logprobs": [_json_float(float(x)) for x in result.logprobs[j, :n]],
                        "text": text, "finish_reason": result.finish_reasons[j]})
    return records


def jsonl_bytes(records: Iterable[dict[str, Any]]) -> bytes:
    """The records as JSON lines: sorted keys, ASCII, compact separators (same records, same bytes)."""
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=True, allow_nan=False, separators=(",", ":")) + "\n"
                   for r in records).encode("ascii")
