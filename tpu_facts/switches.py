"""A scoped on/off switch: off unless the caller is inside ``with switch.on():`` (per thread and per
asyncio task: a ``ContextVar``). The one mechanism behind the project's ambient modes (the
SparseCore ops' trusted inputs and host kernels, Pallas' TPU lowering, deferred state-dict tables,
pooled embeddings kept on the host)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


class Switch:
    """Off by default; :meth:`on` turns it on for the block it guards (nested blocks too)."""

    def __init__(self, name: str) -> None:
        self._on = contextvars.ContextVar(name, default=False)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """On inside the block, back to what it was after (also when the block raises)."""
        token = self._on.set(True)
        try:
            yield
        finally:
            self._on.reset(token)

    def is_on(self) -> bool:
        """Whether the caller is inside an :meth:`on` block."""
        return self._on.get()
