"""A receipt's sampled texts, said in several places, must say the same thing: checked by every `verify`.

An online receipt states each sample four times: the "completions" section (texts, lengths, finish reasons),
`rewards.json` (what was scored), the raw sampler records of `samples.jsonl` (token ids, text, length, finish
reason, row) and, for the accepted group, `completion_tokens.npy` ([G, R] token ids, row k = group sample
`candidate_search.group_samples[k]`, valid up to its length). The manifest binds each file's bytes, but a
forger who edits a text and its reward in one place and re-seals every hash leaves the others showing the
original answer. This module names every disagreement:

- "completions" = `rewards.json` (texts, lengths, finish reasons), candidate by candidate;
- the "rewards" section and `rewards.json`'s texts = `samples.jsonl` (`cross_checks`);
- each sampler record: its length, finish reason and row = `rewards.json`'s, its token count = its length, and
  its text = its tokens detokenised (special tokens skipped, as the run decoded them) with the tokenizer the
  receipt's "prompt.tokenizer" names (the package's shipped tokenizer, else the recorded path, whichever has the
  recorded sha256; neither on this machine: not detokenised, `detokenizer` says why);
- the "probe" section's texts and tokens = the probe's sampler records;
- `completion_tokens.npy` = the accepted group's sampler tokens.

Only artifacts whose hashes verified are read (a broken one is named by the manifest check once). Imports
neither JAX nor numpy (`.npy` files are parsed here); the tokenizer loads through `tokenizers` when a check
needs it.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import struct
from collections.abc import Collection, Mapping
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

REWARDS_KIND = "rewards"  # manifest kinds: a rewards artifact (rewards.json, a parity run's candidates.json) ...
SAMPLES_KIND = "samples"  # ... and the raw sampler records (samples.jsonl)
COMPLETION_TOKENS = "completion_tokens.npy"
_NPY_INTS = {"<i4": "i", "<i8": "q", "<u4": "I", "<u8": "Q", "<i2": "h", "<u2": "H"}


def read_npy_ints(path: Path) -> tuple[tuple[int, ...], list[int]]:
    """(shape, values in C order) of a little-endian integer `.npy` file (np.save's format 1-3), without numpy.
    ValueError for anything else."""
    data = path.read_bytes()
    if data[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy file")
    size_len = 2 if data[6] == 1 else 4
    header_len = int.from_bytes(data[8:8 + size_len], "little")
    start = 8 + size_len + header_len
    header = ast.literal_eval(data[8 + size_len:start].decode("latin1"))
    code = _NPY_INTS.get(header.get("descr"))
    if code is None or header.get("fortran_order"):
        raise ValueError(f"expected a C-order little-endian integer array, got {header!r}")
    shape = tuple(header["shape"])
    count = 1
    for n in shape:
        count *= n
    values = [v for (v,) in struct.iter_unpack("<" + code, data[start:start + count * struct.calcsize(code)])]
    if len(values) != count:
        raise ValueError(f"holds {len(values)} values, its shape {shape} needs {count}")
    return shape, values


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str) -> str:
    from glm52_jax.evidence.hashing import sha256_file

    return sha256_file(path)


@functools.lru_cache(maxsize=2)
def _load_tokenizer(path: str):
    import tokenizers

    return tokenizers.Tokenizer.from_file(path)


def detokenizer(receipt: Mapping[str, Any]) -> tuple[Any, str]:
    """(a `tokenizers.Tokenizer` with the sha256 the receipt's "prompt.tokenizer" records, or None; its path, or
    why there is none)."""
    # The shipped tokenizer (`rollout.tokenizer.default_tokenizer_path`, not imported: rollout imports evidence).
    shipped = os.fspath(resources.files("glm52_jax").joinpath("assets", "tokenizer.json"))
    prompt = receipt.get("prompt")
    record = prompt.get("tokenizer") if isinstance(prompt, Mapping) else None
    if not isinstance(record, Mapping) or not isinstance(record.get("sha256"), str):
        return None, "the receipt names no tokenizer (prompt.tokenizer)"
    for path in (shipped, record.get("path")):  # the shipped one first: the same on every clone
        if isinstance(path, str) and Path(path).is_file() and _file_sha256(path) == record["sha256"]:
            return _load_tokenizer(path), path
    return None, f"tokenizer {record.get('path')} (sha256 {record['sha256']}) is not on this machine"


def _read(run_dir: Path, path: str, readable: Collection[str]) -> Any:
    """A verified JSON / JSONL artifact's contents (JSONL: a list of records); None when it did not verify."""
    if path not in readable:
        return None
    text = (run_dir / PurePosixPath(path)).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()] if path.endswith(".jsonl") else json.loads(text)


def _paths(receipt: Mapping[str, Any], kind: str | None = None, name: str | None = None) -> list[str]:
    manifest = receipt.get("manifest")
    return [e["path"] for e in manifest if isinstance(e, Mapping) and isinstance(e.get("path"), str)
            and (kind is None or e.get("kind") == kind) and (name is None or e["path"].rpartition("/")[2] == name)] \
        if isinstance(manifest, list) else []


def cross_checks(receipt: Mapping[str, Any], path: str, candidates: list, texts_by_candidate: dict | None) -> list[str]:
    """The receipt's "rewards" section and the raw sampler texts against one rewards artifact."""
    failures = []
    section = receipt.get("rewards")
    if section is not None and section != [cd.get("rewards") for cd in candidates if isinstance(cd, dict)]:
        failures.append(f"receipt section 'rewards' {section!r} differs from the rewards in {path}")
    if texts_by_candidate is not None:
        for cd in candidates:
            if not isinstance(cd, dict):
                continue
            raw = texts_by_candidate.get(cd.get("candidate"))
            if raw != cd.get("texts"):
                failures.append(f"{path}: candidate {cd.get('candidate')}: texts differ from samples.jsonl "
                                f"({cd.get('texts')!r} vs {raw!r})")
    return failures


def _completions(receipt: Mapping[str, Any], path: str, candidates: list) -> list[str]:
    section = receipt.get("completions")
    if not isinstance(section, list):
        return []
    scored = {cd.get("candidate"): cd for cd in candidates if isinstance(cd, Mapping)}
    shown = {c.get("candidate"): c for c in section if isinstance(c, Mapping)}
    failures = [f"receipt section 'completions' has no candidate {i}, which {path} scored"
                for i in scored if i not in shown]
    for i, entry in shown.items():
        cd = scored.get(i)
        if cd is None:
            failures.append(f"receipt section 'completions': candidate {i} is not in {path}")
            continue
        for key in ("texts", "lengths", "finish_reasons"):
            if key in entry and entry[key] != cd.get(key):
                failures.append(f"receipt section 'completions': candidate {i} {key} {entry[key]!r} differ from "
                                f"{path}'s {cd.get(key)!r}")
    return failures


def _samples(records: list, path: str, candidates: list, rewards_path: str, tokenizer) -> list[str]:
    """Each sampler record against itself (tokens vs length and text) and against the scored candidate."""
    scored = {cd.get("candidate"): cd for cd in candidates if isinstance(cd, Mapping)}
    failures = []
    for n, r in enumerate(records):
        if not isinstance(r, Mapping) or not isinstance(r.get("tokens"), list):
            continue  # the text-only records of older or hand-made receipts: compared by `cross_checks`
        where = f"{path} line {n + 1} ({r.get('request')} {r.get('candidate')} sample {r.get('sample')})"
        tokens = r["tokens"]
        if len(tokens) != r.get("length"):
            failures.append(f"{where}: {len(tokens)} tokens, length {r.get('length')!r}")
        if tokenizer is not None and all(isinstance(t, int) for t in tokens):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if text != r.get("text"):
                failures.append(f"{where}: text {r.get('text')!r}, but its tokens detokenise to {text!r}")
        cd = scored.get(r.get("candidate")) if r.get("request") == "candidate" else None
        j = r.get("sample")
        if cd is None or not isinstance(j, int):
            continue
        for key, record_key in (("lengths", "length"), ("finish_reasons", "finish_reason")):
            values = cd.get(key)
            if isinstance(values, list) and (j >= len(values) or values[j] != r.get(record_key)):
                failures.append(f"{where}: {record_key} {r.get(record_key)!r}, {rewards_path} says "
                                f"{values[j] if j < len(values) else None!r}")
        if "row" in cd and r.get("row") != cd["row"]:
            failures.append(f"{where}: row {r.get('row')!r}, {rewards_path} scored row {cd['row']!r}")
    return failures


def _probe(receipt: Mapping[str, Any], records: list, path: str) -> list[str]:
    section = receipt.get("probe")
    if not isinstance(section, Mapping):
        return []
    probes = [r for r in records if isinstance(r, Mapping) and r.get("request") == "probe"]
    probes.sort(key=lambda r: r.get("sample", 0))
    failures = []
    for key, record_key in (("texts", "text"), ("tokens", "tokens")):
        if key in section and section[key] != [r.get(record_key) for r in probes]:
            failures.append(f"receipt section 'probe' {key} differ from the probe's records in {path}")
    return failures


def _completion_tokens(receipt: Mapping[str, Any], run_dir: Path, path: str, records: list) -> list[str]:
    """`completion_tokens.npy` [G, R]: row k up to its length = the tokens of group sample k of the accepted one."""
    search = receipt.get("candidate_search")
    accepted = search.get("accepted") if isinstance(search, Mapping) else None
    group = search.get("group_samples") if isinstance(search, Mapping) else None
    if not isinstance(accepted, int) or not isinstance(group, list):
        return [f"{path} is present but candidate_search names no accepted group"]
    try:
        shape, values = read_npy_ints(run_dir / PurePosixPath(path))
    except (OSError, ValueError, SyntaxError) as e:
        return [f"{path}: cannot read it as an integer array ({e})"]
    if len(shape) != 2 or shape[0] != len(group):
        return [f"{path}: shape {list(shape)}, expected [{len(group)}, R] (the accepted group)"]
    sampled = {r.get("sample"): r.get("tokens") for r in records
               if isinstance(r, Mapping) and r.get("request") == "candidate" and r.get("candidate") == accepted}
    failures = []
    width = shape[1]
    for k, j in enumerate(group):
        tokens = sampled.get(j)
        if not isinstance(tokens, list):
            continue  # text-only records
        row = values[k * width:k * width + len(tokens)]
        if row != tokens:
            failures.append(f"{path}: row {k} (candidate {accepted} sample {j}) is {row!r}, the sampler's tokens "
                            f"are {tokens!r}")
    return failures


def _sample_order(j: Any) -> tuple:
    return (0, j, "") if isinstance(j, int) else (1, 0, str(j))  # ints in order; anything else after, not raising


def text_failures(run_dir: Path, receipt: Mapping[str, Any], readable: Collection[str]) -> list[str]:
    """One line per disagreement between the places a receipt states its samples (the module doc); `readable`:
    the manifest paths whose files verified (only those are read)."""
    failures: list[str] = []
    sample_paths = _paths(receipt, SAMPLES_KIND)
    records = None
    if sample_paths:
        try:
            records = _read(run_dir, sample_paths[0], readable)
        except (OSError, ValueError) as e:
            failures.append(f"{sample_paths[0]}: cannot read the sampler records ({type(e).__name__}: {e})")
    if isinstance(records, list):
        failures += _probe(receipt, records, sample_paths[0])
    tokenizer = None
    if isinstance(records, list) and any(isinstance(r, Mapping) and "tokens" in r for r in records):
        tokenizer, _ = detokenizer(receipt)
    for path in _paths(receipt, REWARDS_KIND):
        try:
            candidates = _read(run_dir, path, readable)
        except (OSError, ValueError) as e:
            failures.append(f"{path}: cannot read it as JSON ({e})")
            continue
        if not isinstance(candidates, list):
            continue  # not read, or malformed: `--recompute-rewards` names it
        failures += _completions(receipt, path, candidates)
        if isinstance(records, list):
            texts: dict[Any, dict[int, str]] = {}
            for r in records:
                if isinstance(r, Mapping) and r.get("request") == "candidate":
                    texts.setdefault(r.get("candidate"), {})[r.get("sample")] = r.get("text")
            by_candidate = {c: [t[j] for j in sorted(t, key=_sample_order)] for c, t in texts.items()}
            failures += cross_checks(receipt, path, candidates, by_candidate)
            failures += _samples(records, sample_paths[0], candidates, path, tokenizer)
    if isinstance(records, list):
        failures += [f for p in _paths(receipt, name=COMPLETION_TOKENS) if p in readable
                     for f in _completion_tokens(receipt, run_dir, p, records)]
    return failures
