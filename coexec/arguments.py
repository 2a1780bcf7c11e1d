"""An op's arguments without their tensors, and filled in again: how gradient blocks and call
templates keep an op to issue it later with other tensors (and, for templates, other numbers)."""

from __future__ import annotations

from typing import Any

import torch

from tracegraph.schema import TENSOR_LIST, schema_of


def tensor_slots(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """Where each tensor argument of a call is, in the order the recorder flattens them:
    ``(argument position or name, index in a tensor list or -1)``."""
    sch = schema_of(func)
    slots = []
    for i, name in enumerate(sch.arg_names):
        if i < len(args):
            v, where = args[i], i
        elif name in kwargs:
            v, where = kwargs[name], name
        else:
            continue
        if isinstance(v, torch.Tensor):
            slots.append((where, -1))
        elif sch.kinds[i] == TENSOR_LIST and isinstance(v, (list, tuple)):
            if not isinstance(where, int):
                return None  # (the executor takes tensor lists by position only)
            slots.extend((where, j) for j, t in enumerate(v) if isinstance(t, torch.Tensor))
    return tuple(slots)


def strip(a: Any) -> Any:
    """An argument without its tensors (None in their place)."""
    if isinstance(a, torch.Tensor):
        return None
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return [None if isinstance(x, torch.Tensor) else x for x in a]
    return a


def put(args: list, kwargs: dict, copied: set, arg: Any, item: int, v: Any) -> None:
    """Put ``v`` at argument ``arg`` (a position or a name), item ``item`` of a list there
    (-1: the argument itself). A list is copied the first time (``copied`` records it), so
    the kept arguments stay as they were."""
    holder = args if isinstance(arg, int) else kwargs
    if item < 0:
        holder[arg] = v
        return
    if arg not in copied:
        copied.add(arg)
        holder[arg] = list(holder[arg])
    holder[arg][item] = v
