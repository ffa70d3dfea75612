"""``call_after_import``: every function registered for a module not yet imported runs right after
its body, in order (a second pending registration once replaced the first: only one ran, and the
DTensor rules of the ``tpu::sparse_dense_matmul*`` ops went missing when TorchTPU's names added theirs)."""

from __future__ import annotations

import sys

from torch_tpu.runtime.after_import import call_after_import


def test_every_pending_function_runs_after_the_module_body(tmp_path, monkeypatch):
    (tmp_path / "after_import_probe.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls: list[str] = []

    def first() -> None:
        calls.append(f"first sees READY={sys.modules['after_import_probe'].READY}")

    def second() -> None:
        calls.append("second")

    call_after_import("after_import_probe", "READY", first)
    call_after_import("after_import_probe", "READY", second)
    call_after_import("after_import_probe", "READY", first)  # pending already: not twice
    assert calls == []
    import after_import_probe  # noqa: F401

    assert calls == ["first sees READY=True", "second"]
    call_after_import("after_import_probe", "READY", second)  # imported: at once
    assert calls == ["first sees READY=True", "second", "second"]
    sys.modules.pop("after_import_probe")
