"""Device meshes from a few sizes, with the logical-axis rules that go with them.

Two families of layout:
- orthogonal: axes `data x context x expert x tensor`; the sequence shards over `context`, the
  experts over `expert` (e.g. context 4 x expert 2 on 8 devices);
- folded (the seed's TP1/CP32/EP32/PP1): one `cp_ep` axis shards the sequence in attention *and*
  the experts in the MoE, so the same 32 devices are 32-way CP and 32-way EP.

Model code never names mesh axes: it names logical axes (`seq`, `experts`, ...) and `rules()`
says where they go (see `parallel.rules`).

`weight_sharding` says where the frozen base weights live: "fsdp" (default) shards each one over
every mesh axis its own logical spec leaves unused (for the non-expert weights: all devices), and
the layer scan gathers one layer's weights just before use; "replicated" keeps a whole copy of each
on every device (except what the logical rules shard: the routed experts, tensor-parallel heads).
On one device both are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX is imported where a mesh is made: the run spec parses meshes without it
    import jax
    from jax.sharding import Mesh

    from glm52_jax.parallel.rules import Rules

FOLDED_AXIS = "cp_ep"
WEIGHT_SHARDINGS = ("fsdp", "replicated")  # MeshSpec.weight_sharding (model.weight_sharding of a run)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes. `folded=True` puts context and experts on one axis of size `context`."""

    data: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    folded: bool = False
    weight_sharding: str = "fsdp"

    def __post_init__(self):
        for name in ("data", "context", "expert", "tensor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshSpec.{name}: expected a positive integer, got {value!r}")
        if self.folded and self.expert not in (1, self.context):
            raise ValueError(f"MeshSpec: a folded layout shards experts over the context axis; expert must be 1 or "
                             f"equal to context ({self.context}), got {self.expert}")
        if self.weight_sharding not in WEIGHT_SHARDINGS:
            raise ValueError(f"MeshSpec.weight_sharding: expected one of {WEIGHT_SHARDINGS}, got "
                             f"{self.weight_sharding!r}")

    @classmethod
    def seed_training(cls, devices: int = 32) -> MeshSpec:
        """The seed's training topology: TP1 / CP=devices / EP=devices / PP1 on one folded axis."""
        return cls(context=devices, expert=devices, folded=True)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("data", FOLDED_AXIS, "tensor") if self.folded else ("data", "context", "expert", "tensor")

    @property
    def shape(self) -> tuple[int, ...]:
        if self.folded:
            return (self.data, self.context, self.tensor)
        return (self.data, self.context, self.expert, self.tensor)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def describe(self) -> str:
        """Megatron-style summary, e.g. `DP1/TP1/CP32/EP32/PP1`."""
        ep = self.context if self.folded else self.expert
        return f"DP{self.data}/TP{self.tensor}/CP{self.context}/EP{ep}/PP1"

    def rules(self) -> Rules:
        """Logical-axis rules for this layout (with "fsdp": every mesh axis shards the base weights)."""
        from glm52_jax.parallel.rules import DEFAULT_RULES, FSDP

        table = DEFAULT_RULES
        if self.folded:
            table = tuple((name, FOLDED_AXIS if target in ("context", "expert") else target)
                          for name, target in DEFAULT_RULES)
        if self.weight_sharding == "fsdp":
            table = (*table, (FSDP, self.axis_names))
        return table

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh over `devices` (default: all); their number must equal the product of the sizes."""
        import jax
        from jax.sharding import AxisType

        devices = list(jax.devices() if devices is None else devices)
        if len(devices) != self.size:
            raise ValueError(f"mesh {self.describe()} needs {self.size} devices "
                             f"({' x '.join(f'{n}={s}' for n, s in zip(self.axis_names, self.shape))}), "
                             f"but {len(devices)} are available")
        return jax.make_mesh(self.shape, self.axis_names, axis_types=(AxisType.Auto,) * len(self.shape),
                             devices=devices)


def parse_mesh(text: str, weight_sharding: str = "fsdp") -> MeshSpec:
    """`"context=4,expert=2"` or `"folded=32"` (the seed's layout on 32 devices) -> MeshSpec."""
    fields: dict[str, int] = {}
    folded = False
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"mesh {text!r}: expected name=integer items, got {part!r}")
        key, number = key.strip(), int(value)
        if key == "folded":
            folded = True
            fields["context"] = fields["expert"] = number
        elif key in ("data", "context", "expert", "tensor"):
            fields[key] = number
        else:
            raise ValueError(f"mesh {text!r}: unknown axis {key!r} (data, context, expert, tensor, folded)")
    return MeshSpec(folded=folded, weight_sharding=weight_sharding, **fields)
