"""TensorBoard event files of a run: the per-step scalars of metrics.jsonl, via tensorboardX (no TensorFlow).

Written to WORKDIR/tensorboard/ (`tensorboard --logdir WORKDIR` finds them); each process that resumes the
run adds an event file, and TensorBoard merges them by step. A scalar is tagged by group: `train/loss`,
`reward/mean`, `time/decode_seconds`, ... (`TAGS`); the wall time of each point is the step record's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

TENSORBOARD_DIR = "tensorboard"

# metrics.jsonl "step" record field -> TensorBoard tag. Only these are written (the record's other fields are
# identifiers and texts); a field a step did not compute (no update: no loss) is left out of that step.
TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "clipfrac_low": "train/clipfrac_low",
    "clipfrac_high": "train/clipfrac_high",
    "clipfrac_dual": "train/clipfrac_dual",
    "approx_kl": "train/approx_kl",
    "kl_after_update": "train/kl_after_update",
    "sampled_entropy": "train/sampled_entropy",
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "accepted_candidate": "search/accepted_candidate",
    "candidates_tried": "search/candidates_tried",
    "probe_seconds": "time/probe_seconds",
    "prefill_seconds": "time/prefill_seconds",
    "decode_seconds": "time/decode_seconds",
    "reward_seconds": "time/reward_seconds",
    "update_seconds": "time/update_seconds",
    "checkpoint_seconds": "time/checkpoint_seconds",
    "step_seconds": "time/step_seconds",
    "prefill_tokens_per_s": "throughput/prefill_tokens_per_s",
    "decode_tokens_per_s": "throughput/decode_tokens_per_s",
}


class ScalarWriter:
    """`write(record)`: the TAGS fields of a metrics.jsonl step record as scalars at `record["step"]`.

    One event per step, written and flushed before `write` returns: tensorboardX's `SummaryWriter` queues
    events for a background thread that flushes every 2 minutes, so a process killed later in the run lost
    the points of steps it had committed (seen in the resume test); its synchronous `EventsWriter` does not.
    """

    def __init__(self, workdir: str | Path):
        from tensorboardX.event_file_writer import EventsWriter

        self.directory = Path(workdir) / TENSORBOARD_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        # The file name holds the start second and host; the pid keeps a quick restart's file apart.
        self._events = EventsWriter(str(self.directory / "events"), filename_suffix=f".{os.getpid()}")

    def write(self, record: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(record[field])) for field, tag in TAGS.items()
                  if _is_number(record.get(field))]
        self._events.write_event(Event(wall_time=record["time"], step=int(record["step"]),
                                       summary=Summary(value=values)))
        self._events.flush()

    def close(self) -> None:
        self._events.close()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
