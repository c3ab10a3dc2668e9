"""``cp=`` has one type above the layer, ``csattn.layers.plan.ContextParallelGroup``: ``csattn.ContextParallel``
has every member it names, each method taking as many arguments (a renamed or changed member would leave the model,
the capture-safe step and the trainer calling what is not there)."""

import inspect
from typing import Generic, Protocol

from csattn.cp import ContextParallel
from csattn.layers.plan import ContextParallelGroup


def _members(protocol: type) -> set[str]:
    names: set[str] = set()
    for base in protocol.__mro__:
        if base not in (object, Protocol, Generic):
            names |= set(getattr(base, "__annotations__", {})) | {n for n in vars(base) if not n.startswith("_")}
    return names


def test_context_parallel_has_every_member_of_the_cp_type():
    names = _members(ContextParallelGroup)
    assert {"plan", "rank", "size", "group", "partition", "local_rows", "shard"} <= names
    missing = [n for n in names if not hasattr(ContextParallel, n) and n not in ContextParallel.__dataclass_fields__]
    assert not missing, f"ContextParallel lacks {missing}"
    for name in names:
        want = getattr(ContextParallelGroup, name, None)
        if inspect.isfunction(want):
            have = inspect.signature(getattr(ContextParallel, name)).parameters
            assert len(have) == len(inspect.signature(want).parameters), name
