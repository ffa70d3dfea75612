"""Errors raised by tpu ops inside autograd's backward reach ``loss.backward()`` as themselves.

The autograd engine runs each backward node under a stream guard of the node's device. For the
tpu device that guard is PyTorch's Python device guard, whose destructor calls into Python. A
Python exception from ``__torch_dispatch__`` leaves the C++ call unwinding with the Python error
still set; the guard's call into Python then fails inside a ``noexcept`` destructor and the
process aborts ("terminate called without an active exception"), or the error is swallowed
("SystemError: run_backward returned NULL").

So an exception raised while a C++ backward node calls into the tpu device is not raised there:
it is recorded, the op returns a placeholder that the C++ side rejects with a plain C++ error (no
Python error set, so the guard unwinds cleanly), and the engine call made by
``torch.autograd.backward`` / ``torch.autograd.grad`` re-raises the recorded exception, with a note
naming the op. Tensor hooks (``register_hook``, ``register_post_accumulate_grad_hook``), which the engine calls
from C++ too, are wrapped the same way. Exceptions in an ``autograd.Function``'s backward are
raised normally: PyTorch handles those itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd
import torch.autograd.graph

_pending: list[BaseException] = []  # recorded exceptions, oldest first (nested backward: innermost last)


class _Deferred:
    """What a failed op gives back to the engine; its repr is in the C++ error's message."""

    def __init__(self, what: str, error: BaseException) -> None:
        self.text = f"{what}: {type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"<tpu backward failed ({self.text}); loss.backward() raises the original exception>"


def _engine_frame(frame: Any) -> bool:
    """Whether the Python frame below the dispatch is the autograd engine itself (or none)."""
    return frame is None or (
        frame.f_code.co_name == "_engine_run_backward" and frame.f_code.co_filename == _GRAPH_FILE
    )


_GRAPH_FILE = torch.autograd.graph.__file__


def defer(func: Any, error: BaseException) -> _Deferred | None:
    """Record ``error`` raised by ``func`` when a C++ backward node called it (then return the
    placeholder to give back); None when the error can be raised normally."""
    if torch._C._current_graph_task_id() == -1:
        return None
    if not _engine_frame(sys._getframe(1).f_back):  # the caller of __torch_dispatch__, if Python
        return None
    if str(func) not in str(error) and not any(str(func) in n for n in getattr(error, "__notes__", ())):
        error.add_note(f"raised by {func} on the tpu device during the backward pass")
    _pending.append(error)
    return _Deferred(str(func), error)


def guard_mode(mode_type: type) -> None:
    """Defer the exceptions of a dispatch mode's ``__torch_dispatch__`` as :func:`defer` does a tpu
    op's: torch.compile traces backward nodes of tpu tensors through its fake, functional and proxy
    modes, whose errors (an op without a fake kernel ...) would otherwise abort the process."""
    dispatch = mode_type.__torch_dispatch__
    if getattr(dispatch, "_tpu_deferring", False):
        return

    @functools.wraps(dispatch)
    def deferring(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return dispatch(self, func, types, args, kwargs)
        except BaseException as error:
            deferred = defer(func, error)
            if deferred is None:
                raise
            return deferred

    deferring._tpu_deferring = True  # type: ignore[attr-defined]
    mode_type.__torch_dispatch__ = deferring


def guard_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a tensor hook, which the engine calls from C++), with its exceptions deferred."""

    @functools.wraps(hook)
    def guarded(*args: Any) -> Any:
        try:
            return hook(*args)
        except BaseException as error:
            if torch._C._current_graph_task_id() == -1:
                raise
            _pending.append(error)
            return torch.empty(0)  # a CPU tensor: the engine rejects it with a plain C++ error

    return guarded


def _reraising(run: Callable[..., Any]) -> Callable[..., Any]:
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        start = len(_pending)
        try:
            result = run(*args, **kwargs)
        except BaseException:
            _reraise_recorded(start)
            raise
        _reraise_recorded(start)  # an op without outputs accepts the placeholder silently
        return result

    run_backward._tpu_reraising = True  # type: ignore[attr-defined]
    return run_backward


def _reraise_recorded(start: int) -> None:
    if len(_pending) <= start:
        return
    error = _pending[start]
    del _pending[start:]
    raise error.with_traceback(error.__traceback__) from None


def install() -> None:
    """Route torch.autograd's engine calls through :func:`_reraising` (idempotent)."""
    current = torch.autograd.graph._engine_run_backward
    if getattr(current, "_tpu_reraising", False):
        return
    wrapped = _reraising(current)
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped
