"""What the MXNet face decides without MXNet or MPI (pure, tested in the main environment):
how gradients are cut into groups, and the checks on the trainer's arguments."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence


def split_list(items: Sequence[Any], parts: int) -> list:
    """``items`` cut into ``parts`` consecutive runs whose lengths differ by at most one, the
    longer first (pure). ``split_list([1, 2, 3, 4, 5], 2)`` -> ``[[1, 2, 3], [4, 5]]``."""
    items = list(items)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"num_groups must be a whole number >= 1 here, got {parts!r}")
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(items[start:start + n])
        start += n
    return [o for o in out if o]


def group_by_dtype(entries: Sequence[tuple]) -> list:
    """``(tensor, name)`` entries in runs of one dtype each, first-seen order (pure over
    anything with ``.dtype``): one grouped allreduce per dtype, as Horovod does."""
    runs: "OrderedDict[str, list]" = OrderedDict()
    for t, name in entries:
        runs.setdefault(str(t.dtype), []).append((t, name))
    return list(runs.values())


def check_predivide(factor: Any) -> float:
    try:
        f = float(factor)
    except (TypeError, ValueError):
        raise TypeError(f"gradient_predivide_factor must be a number, got {factor!r}") from None
    if f == 0.0:
        raise ValueError("gradient_predivide_factor must not be 0; 1.0 (the default) averages "
                         "after the sum")
    return f
