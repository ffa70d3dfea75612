"""The compiler options whole programs get by default on a platform (``runtime.compiler_options``):
on XLA:CPU, copy insertion's region analysis, so donated weights are updated in place, not copied
each run; the same values bit for bit, and an option the user sets wins."""

from __future__ import annotations

import numpy as np
import pytest

import torch_tpu  # noqa: F401
from torch_tpu.compile.program.executables import CompiledProgram
from torch_tpu.runtime import compiler_options
from torch_tpu.runtime._jax import jax, jnp

REGION = "xla_cpu_copy_insertion_use_region_analysis"


def _step(w1, w2, x):
    """Two layers and an in-place SGD update: ``w2`` is read by the forward's product and by the
    backward's input-gradient product, which the update of ``w2`` does not depend on."""
    h = jnp.maximum(x @ w1.T, 0)
    g = h @ w2.T
    dw2 = g.T @ h
    dh = (g @ w2) * (h > 0)
    dw1 = dh.T @ x
    return w1 - 0.05 * dw1, w2 - 0.05 * dw2, dh.sum()


def _operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1) for shape in ((64, 48), (32, 64), (16, 48))]


def _parameter_copies(compiled) -> list[str]:
    text = compiled.as_text()
    return [line for line in text[text.index("ENTRY"):].splitlines() if " copy(" in line and "parameter" not in line]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA:CPU's copy insertion")
def test_cpu_programs_update_donated_weights_in_place_with_the_same_values() -> None:
    lowered = jax.jit(_step, donate_argnums=(0, 1)).lower(*_operands())
    plain = lowered.compile()
    defaults = lowered.compile(
        compiler_options=compiler_options.for_jax(compiler_options.with_platform_defaults((), "cpu")))
    assert _parameter_copies(plain)  # what the default is for: XLA's own keeps a copy of w2 each run
    assert _parameter_copies(defaults) == []
    results = []
    for compiled in (plain, defaults):
        w1, w2, x = _operands()
        for _ in range(3):
            w1, w2, loss = compiled(w1, w2, x)
        results.append([np.asarray(v) for v in (w1, w2, loss)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_whole_programs_get_the_defaults_and_match_jit() -> None:
    program = CompiledProgram(_step, donated=(0, 1))
    reference = jax.jit(_step)
    w1, w2, x = _operands(1)
    r1, r2 = jnp.array(w1), jnp.array(w2)  # (the program takes w1, w2 by donation)
    for _ in range(3):
        w1, w2, loss = program(w1, w2, x)
        r1, r2, expected = reference(r1, r2, x)
    for got, want in ((w1, r1), (w2, r2), (loss, expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_option_set_wins_over_the_platform_default() -> None:
    assert compiler_options.with_platform_defaults((), "cpu") == ((REGION, "true"),)
    mine = ((REGION, "false"), ("xla_cpu_enable_fast_math", "false"))
    assert compiler_options.with_platform_defaults(mine, "cpu") == tuple(sorted(mine))
    assert compiler_options.with_platform_defaults(mine, "tpu") == mine
    assert compiler_options.for_jax(compiler_options.with_platform_defaults((), "cpu")) == {REGION: True}
