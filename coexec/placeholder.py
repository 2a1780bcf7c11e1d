"""Placeholder tensors: what ops return while the skeleton runs (DESIGN.md §4).

A placeholder has a tensor's metadata and no data; autograd runs on placeholders like on any
tensor. When the executor has produced its value, the placeholder is *bound* to it, and from
then on it behaves as that real tensor everywhere: ops on it compute on the real tensor, data
access (``.numpy()``, ``.tolist()``, printing, pickling) reads the real tensor. So a placeholder
that escapes the step (a loss in a user's list, a carried hidden state) just works afterwards.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from tracegraph.schema import TensorMeta

from .errors import CoexecError, ValueLostError

if TYPE_CHECKING:
    from .skeleton import Session

_TB = torch._C.TensorBase
# Methods that read the data without an ATen op: they run on the bound real tensor.
_DATA_ACCESS = frozenset(
    {
        _TB.numpy, _TB.tolist, _TB.data_ptr, _TB.untyped_storage, torch.Tensor._typed_storage,
        torch.Tensor.__array__, torch.Tensor.storage, torch.Tensor.__dlpack__,
        torch.Tensor.__dlpack_device__,
    }
)  # fmt: skip
_REPR_INDENT = len("tensor(")


class Placeholder(torch.Tensor):
    """A tensor whose value the executor computes (see the module docstring)."""

    _session: "Session | None"
    _vid: int
    _real: torch.Tensor | None

    @staticmethod
    def __new__(cls, meta: TensorMeta, session: "Session | None", vid: int) -> "Placeholder":
        # a sparse or other non-strided layout has no strides nor storage offset to give
        strided = meta.layout == torch.strided
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride if strided else None,
            storage_offset=0 if strided else None,
            dtype=meta.dtype,
            device=meta.device,
            layout=meta.layout,
            requires_grad=False,  # autograd sets it above the dispatcher, as for any op output
        )
        if meta.bits & 1:
            torch._C._set_conj(t, True)
        if meta.bits & 2:
            torch._C._set_neg(t, True)
        t._session = session
        t._vid = vid
        t._real = None
        return t

    def real_tensor(self) -> torch.Tensor:
        """The real tensor, waiting for the executor to produce it if needed."""
        r = self._real
        if r is None:
            if self._session is None:
                raise ValueLostError("this placeholder's value was never computed")
            r = self._session.resolve(self)
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if torch.Tag.inplace_view in func.tags and isinstance(args[0], Placeholder):
            raise CoexecError(
                f"{func} would change the shape or strides of a tensor that coexec computed in "
                "the background, in place; that is not supported. Use the out-of-place form "
                "(for example x = x.unsqueeze(0) instead of x.unsqueeze_(0))."
            )
        return func(*_unwrap_all(args), **_unwrap_all(kwargs or {}))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _DATA_ACCESS:
            return func(*_unwrap_all(args), **_unwrap_all(kwargs))
        special = _SPECIAL.get(func)
        if special is not None:
            return special(*args, **kwargs)
        if func is torch.Tensor.__format__:
            self, spec = args[0], args[1]
            if self.dim() == 0:
                return self.real_tensor().detach().item().__format__(spec)
            return object.__format__(self, spec)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# printing uses the type's name as its prefix: a placeholder prints as ``tensor(...)`` like the
# tensor it stands for (the class keeps its qualified name for debugging).
Placeholder.__name__ = "tensor"


def _unwrap(x: Any) -> Any:
    return x.real_tensor() if isinstance(x, Placeholder) else x


def _unwrap_all(x: Any) -> Any:
    """``x`` (an op's arguments: tuples, lists, dicts) with every placeholder its real tensor.
    Not ``torch.utils._pytree.tree_map``: its recursive closure is a reference cycle per call,
    left to the garbage collector."""
    if isinstance(x, Placeholder):
        return x.real_tensor()
    if type(x) in (tuple, list):
        return type(x)(_unwrap_all(y) for y in x)
    if type(x) is dict:
        return {k: _unwrap_all(v) for k, v in x.items()}
    return x


def _plain(ph: Placeholder) -> torch.Tensor:
    """The value as an ordinary tensor that says what the placeholder says about gradients
    (the executor's values never require grad: it runs below autograd)."""
    t = ph.real_tensor().detach()
    return t.requires_grad_() if ph.requires_grad and not t.requires_grad else t


def _repr(ph: Placeholder, *, tensor_contents: str | None = None) -> str:
    """``repr`` as eager prints the tensor: the values from the real tensor, the suffixes
    (``grad_fn=...``, ``requires_grad=True``) from the placeholder, which autograd ran on."""
    if tensor_contents is None:
        real = ph.real_tensor()
        if real.numel() and real.layout == torch.strided:
            with torch.no_grad(), torch.utils._python_dispatch._disable_current_modes():
                tensor_contents = torch._tensor_str._tensor_str(real.detach(), _REPR_INDENT)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.__repr__(ph, tensor_contents=tensor_contents)


def _reduce_ex(ph: Placeholder, protocol: int) -> Any:
    """Pickled (``torch.save``, ``pickle``) as the plain tensor eager would have: the values,
    and ``requires_grad`` as the placeholder has it; never the placeholder's bookkeeping."""
    return _plain(ph).__reduce_ex__(protocol)


def _deepcopy(ph: Placeholder, memo: dict) -> torch.Tensor:
    """``copy.deepcopy``: a plain tensor, as eager makes; a non-leaf raises eager's error."""
    if not ph.is_leaf:
        with torch._C.DisableTorchFunctionSubclass():
            torch.Tensor.__deepcopy__(ph, memo)  # raises "Only Tensors created explicitly..."
    # the real tensor, not a temporary: deepcopy's memo is keyed by id(), and a temporary's
    # id is reused by the next one (two placeholders would get the same copy)
    new = copy.deepcopy(ph.real_tensor(), memo)
    if ph.requires_grad and not new.requires_grad:
        new.requires_grad_()
    memo[id(ph)] = new
    return new


_SPECIAL = {
    torch.Tensor.__repr__: _repr,
    torch.Tensor.__reduce_ex__: _reduce_ex,
    torch.Tensor.__deepcopy__: _deepcopy,
}


# What the interpret backend's placeholders need of torch, installed by its first co-executed
# step (install_for_placeholders), never at import: a program that imports coexec and does not
# run such a step sees torch unchanged.
#
# ``nn.Parameter(t)`` of a tensor of the step (``copy.deepcopy(model)`` makes one of each
# parameter's ``data.clone()``): a parameter is a new leaf over the value, so it is made of the
# real tensor (Python waits for it), as eager makes it of a plain tensor. Without this,
# ``Parameter`` takes its path for tensor subclasses, whose ``detach()`` is an op eager never
# ran there: the step fell back at it, and the parameter came out a plain tensor, an error.
#
# Code that picks a path by a tensor's exact type (``clip_grad_norm_``'s foreach norms, the
# optimizers' foreach default) takes the path eager takes for a placeholder too, as torch does
# for its DTensor: else a co-executed step took the per-tensor loop where its traced steps took
# ``_foreach_norm``, another path (one more trace for every program that clips gradients).
_PARAMETER_NEW = torch.nn.Parameter.__new__
_installed = False


def _parameter_new(cls: type, data: Any = None, requires_grad: bool = True) -> torch.Tensor:
    if isinstance(data, Placeholder):
        data = data.real_tensor()
    return _PARAMETER_NEW(cls, data, requires_grad)


def install_for_placeholders() -> None:
    """Make torch take placeholders as it takes plain tensors (above); once, at the first
    co-executed step of the interpret backend (placeholders may outlive it: ``sync="none"``)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch.optim.optimizer import _foreach_supported_types as optim_foreach
    from torch.utils._foreach_utils import _foreach_supported_types as utils_foreach

    torch.nn.Parameter.__new__ = staticmethod(_parameter_new)
    for types in (utils_foreach, optim_foreach):
        if Placeholder not in types:
            types.append(Placeholder)
