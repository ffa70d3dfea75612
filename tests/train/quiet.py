"""The third-party noise :mod:`torchrec_tpu.log_setup` silences, and the check that a log holds none."""

from __future__ import annotations

NOISE = ("is_fx_tracing", "Successfully loaded", ".so'", "libtpu.so", "broadcast_buffers", "FutureWarning",
         "Resetting cache", "\x1b[", "\r")


def assert_quiet(text: str) -> None:
    """None of the silenced lines, no ANSI colours, no carriage-return redraws."""
    found = [n for n in NOISE if n in text]
    assert not found, f"{found} in:\n{text[-4000:]}"
