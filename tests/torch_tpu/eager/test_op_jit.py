"""The per-op jit cache (torch_tpu.eager.op_jit): hits/misses, results vs plain lowerings and CPU torch,
in-place and view ops through it, traced float arguments, the size cap and the env switch."""

from __future__ import annotations

import importlib

import pytest
import torch

import torch_tpu
from torch_tpu.eager import modes, op_jit


@pytest.fixture(autouse=True)
def fresh_cache():
    op_jit.clear()
    op_jit.reset_stats()
    yield
    op_jit.set_enabled(True)
    op_jit.set_max_entries(1024)
    op_jit.clear()


def _three_times(fn):
    """fn() three times: the first call compiles its program, the later ones reuse it."""
    return [fn().cpu() for _ in range(3)]


def test_first_sight_compiles_and_later_calls_hit():
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    xt, yt = x.to("tpu"), y.to("tpu")
    seen = []
    for _ in range(3):
        out = (xt + yt).cpu()
        s = op_jit.stats()
        seen.append((s.misses, s.compiles, s.hits))
        torch.testing.assert_close(out, x + y, rtol=0, atol=0)
    assert seen == [(0, 1, 1), (0, 1, 2), (0, 1, 3)]
    xt.add(yt[:4].sum(0))  # two more signatures (sum, add), each compiled on its first call
    assert op_jit.stats().compiles == 3


OPS = {
    "add": lambda a, b: a + b,
    "sub_scalar": lambda a, b: a - 3,
    "lt": lambda a, b: a < b,
    "where": lambda a, b: torch.where(a > b, a, b),
    "sum_dim": lambda a, b: a.sum(1),
    "cat_t": lambda a, b: torch.cat([a.t(), b.t()], 1),
}
FLOAT_OPS = {
    "div": lambda a, b: a / b,
    "mm": lambda a, b: a @ b.t(),
    "softmax": lambda a, b: a.softmax(-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_results_identical_with_cache_on_and_off(dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(6, 7, generator=gen) * 4).to(dtype) for _ in range(2))
    at, bt = a.to("tpu"), b.to("tpu")
    ops = {**OPS, **(FLOAT_OPS if dtype.is_floating_point else {})}
    for name, op in ops.items():
        op_jit.set_enabled(False)
        plain = op(at, bt).cpu()
        op_jit.set_enabled(True)
        for got in _three_times(lambda: op(at, bt)):
            assert got.dtype == plain.dtype, name
            assert torch.equal(got, plain), name
        if dtype != torch.bfloat16:  # CPU torch rounds bf16 differently inside composite ops
            torch.testing.assert_close(plain, op(a, b), msg=name)
    assert op_jit.stats().hits >= len(ops)


def test_inplace_and_view_ops_through_the_cache_alias_like_cpu():
    def program(device):
        base = torch.arange(48.0, device=device).reshape(6, 8)
        other = (torch.arange(-4.0, 4.0) / 4).to(device)  # exact values (CPU linspace rounds by vector width)
        outs = []
        for step in range(3):
            cols = base[:, 1::2]  # non-contiguous view written in place
            cols.mul_(1.5).add_(other[:4])
            base.t()[2].sub_(step)  # column of a transpose
            row = base[step]
            row.clamp_(min=5.0)
            torch.add(base[1:3], 1, out=base[3:5])  # out= into a view
            outs.append(base.clone())
        return [*outs, cols, row]

    cpu = program("cpu")
    tpu = [t.cpu() for t in program("tpu")]
    for got, want in zip(tpu, cpu):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert op_jit.stats().hits > 0


def test_changing_float_args_become_traced_inputs():
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    xt, yt = x.to("tpu"), y.to("tpu")
    alphas = [0.1, 0.25, -3.0, 7.5, 1e-3, 2.0, 0.0, -0.0, 1.0]
    for alpha in alphas:
        got = torch.add(xt, yt, alpha=alpha).cpu()
        torch.testing.assert_close(got, torch.add(x, y, alpha=alpha), rtol=1e-6, atol=1e-6)
    s = op_jit.stats()
    assert s.promotions == 1
    assert s.compiles == 3 + 1  # one program per alpha for the first 3, then one traced program for all
    assert s.hits == len(alphas)


def test_float_args_stay_constant_where_tracing_changes_the_result_dtype():
    xi = torch.arange(6).to("tpu")  # int tensor * Python float -> default float dtype, not float64
    for k in range(8):
        got = xi.mul(0.5 + k)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), torch.arange(6).mul(0.5 + k), rtol=0, atol=0)
    assert op_jit.stats().promotions == 0


def test_foreach_scalar_lists_like_adam_bias_corrections():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 4, generator=gen), torch.randn(7, generator=gen)]
    num = [torch.randn_like(p) for p in params]
    den = [torch.rand_like(p) + 0.5 for p in params]
    tpu = [[t.to("tpu") for t in ts] for ts in (params, num, den)]
    for step in range(1, 8):
        scales = [-1e-3 / (1 - 0.9**step), -2e-3 / (1 - 0.99**step)]
        torch._foreach_addcdiv_(params, num, den, scales)
        torch._foreach_addcdiv_(*tpu, scales)
    for got, want in zip(tpu[0], params):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)
    assert op_jit.stats().promotions == 1


def test_size_cap_evicts_least_recently_used():
    op_jit.set_max_entries(2)
    tensors = [torch.ones(n).to("tpu") for n in (2, 3, 4)]  # built on CPU: no program of their own
    for t in tensors:
        for _ in range(2):
            (t * 2).cpu()
    s = op_jit.stats()
    assert (s.compiles, s.evictions, op_jit.size()) == (3, 1, 2)
    (tensors[2] * 2).cpu()  # most recent: still cached
    assert op_jit.stats().hits == 7
    (tensors[0] * 2).cpu()  # evicted: compiled again
    assert op_jit.stats().compiles == 4


def test_an_evicted_traced_floats_program_still_takes_each_calls_floats():
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    xt, yt = x.to("tpu"), y.to("tpu")
    for alpha in (0.1, 0.2, 0.3, 0.4):  # the 4th distinct value makes alpha a traced input
        torch.add(xt, yt, alpha=alpha)
    assert op_jit.stats().promotions == 1
    op_jit.set_max_entries(1)
    (xt * 2).cpu()  # evicts the traced program
    for alpha in (0.5, 2.0, -3.0):  # rebuilt on the first of these: each call's alpha counts
        torch.testing.assert_close(torch.add(xt, yt, alpha=alpha).cpu(), torch.add(x, y, alpha=alpha))


def test_env_switch_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv("TORCH_TPU_OP_JIT", "0")
    importlib.reload(op_jit)
    try:
        assert not op_jit.enabled()
        x = torch.ones(3, device="tpu")
        for _ in range(3):
            torch.testing.assert_close((x + x).cpu(), torch.full((3,), 2.0))
        assert (op_jit.stats().compiles, op_jit.size()) == (0, 0)
    finally:
        monkeypatch.delenv("TORCH_TPU_OP_JIT")
        importlib.reload(op_jit)
    assert op_jit.enabled()


def test_debug_mode_checks_still_name_the_op_on_cached_programs():
    x = torch.tensor([1.0, -1.0], device="tpu")
    with torch_tpu.eager_mode("debug"):
        for _ in range(3):
            with pytest.raises(FloatingPointError, match="aten.log.default"):
                torch.log(x)
        idx = torch.tensor([0, 5], device="tpu")
        for _ in range(3):
            with pytest.raises(IndexError, match="index 5 is out of bounds"):
                torch.index_select(x, 0, idx)
    assert op_jit.stats().hits >= 1  # log ran from a compiled program and was still checked
    assert modes.get_eager_mode() == torch_tpu.EagerMode.STRICT


def test_clear_handler_cache_drops_compiled_programs():
    x = torch.ones(3).to("tpu")
    for _ in range(2):
        (x - 1).cpu()
    assert op_jit.size() == 1
    torch_tpu.clear_handler_cache()
    assert op_jit.size() == 0


def test_programs_that_only_hand_back_their_inputs_run_plainly():
    x = torch.arange(4.0, device="tpu")
    copies = [x.clone() for _ in range(3)]  # clone's lowering returns its (immutable) input
    s = op_jit.stats()
    assert (s.compiles, s.untraceable, s.hits) == (0, 0, 0)
    x.add_(1)
    for c in copies:
        torch.testing.assert_close(c.cpu(), torch.arange(4.0), rtol=0, atol=0)


def test_programs_whose_outputs_are_constants_compile_once():
    """``ones_like`` of a 0-d tensor traces to no equations (its output is a constant), but unlike
    a clone it computes something: one program, hit afterwards, not the lowering op by op."""
    for dtype in (torch.float32, torch.int64, torch.bool):
        op_jit.clear()
        op_jit.reset_stats()
        x = torch.tensor(3, dtype=dtype)
        got = _three_times(lambda: torch.ones_like(x.to("tpu")))
        s = op_jit.stats()
        assert (s.compiles, s.misses) == (1, 0), (dtype, s)
        for out in got:
            assert out.dtype == dtype and out.shape == ()
            torch.testing.assert_close(out, torch.ones_like(x), rtol=0, atol=0)


def _signs(t: torch.Tensor) -> torch.Tensor:
    return torch.copysign(torch.ones_like(t), t)


def test_fast_path_keeps_every_argument_apart():
    """Calls after the compile skip the dispatch machinery (``op_jit.fast``); arguments that
    compare equal but give other results (0.0 / -0.0, True / 1, other dims) still get their own
    programs, and every result matches CPU torch."""
    x = torch.randn(4, 5)
    xt = x.to("tpu")
    flags = torch.tensor([True, False])
    for _ in range(3):
        for scale in (0.0, -0.0):
            torch.testing.assert_close(_signs((xt * scale).cpu()), _signs(x * scale))
        for dim in ([0], [1]):
            torch.testing.assert_close(xt.sum(dim).cpu(), x.sum(dim))
        for other in (True, 1):
            got, want = (flags.to("tpu") + other).cpu(), flags + other
            assert got.dtype == want.dtype and torch.equal(got, want)
        torch.testing.assert_close(xt.relu().cpu(), x.relu())
    fast = {entry[0].__name__ for entry in op_jit.fast.values()}
    assert {"mul.Tensor", "sum.dim_IntList", "add.Tensor", "relu.default"} <= fast
    before = op_jit.stats()
    torch.testing.assert_close((xt * 2.5).relu().cpu(), (x * 2.5).relu())  # a new scale: compiled
    after = op_jit.stats()
    assert (after.compiles, after.hits) == (before.compiles + 1, before.hits + 2)  # relu: fast


def test_fast_path_errors_are_torch_errors():
    a, b = torch.ones(3, device="tpu"), torch.ones(3, device="tpu")
    for _ in range(3):
        (a + b).cpu()
    with pytest.raises(RuntimeError, match="must match the size"):
        a + torch.ones(4, device="tpu")


def test_fast_in_place_ops_update_the_target_and_its_views():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    xt, yt = x.to("tpu"), y.to("tpu")
    row, row_t = x[1], xt[1]  # a view sees every update of its base
    for _ in range(4):
        assert xt.add_(yt) is xt and xt.mul_(0.5) is xt
        x.add_(y).mul_(0.5)
        torch.testing.assert_close(xt.cpu(), x)
        torch.testing.assert_close(row_t.cpu(), row)
    assert {"add_.Tensor", "mul_.Tensor"} <= {entry[0].__name__ for entry in op_jit.fast.values()}
    wide = torch.ones(3, 4, dtype=torch.float64)
    for _ in range(3):  # a float64 operand: the result is cast into the float32 target, not stored whole
        xt.add_(wide.to("tpu"))
        x.add_(wide)
    assert xt.dtype == torch.float32
    torch.testing.assert_close(xt.cpu(), x)



def _fast_keyword_ops() -> set[str]:
    """Ops with a fast-path program for a call with keyword arguments (keys hold their names)."""
    return {entry[0].__name__ for key, entry in op_jit.fast.items() if any(type(k) is str for k in key)}


KEYWORD_CALLS = {  # name: (op on (x, y), writes into x, the overload the fast path serves or None)
    "add_alpha": (lambda x, y: x.add_(y, alpha=2.5), True, "add_.Tensor"),
    "sub_alpha": (lambda x, y: x.sub_(y, alpha=-0.5), True, "sub_.Tensor"),
    "add_alpha_int": (lambda x, y: x.add_(y, alpha=3), True, "add_.Tensor"),
    "div_floor": (lambda x, y: x.div_(y, rounding_mode="floor"), True, "div_.Tensor_mode"),
    "div_trunc": (lambda x, y: x.div_(y, rounding_mode="trunc"), True, "div_.Tensor_mode"),
    "add": (lambda x, y: torch.add(x, y, alpha=-2.0), False, "add.Tensor"),
    "sub": (lambda x, y: torch.sub(x, y, alpha=0.25), False, "sub.Tensor"),
    "div_floor_fn": (lambda x, y: torch.div(x, y, rounding_mode="floor"), False, "div.Tensor_mode"),
    "div_none_fn": (lambda x, y: torch.div(x, y, rounding_mode=None), False, "div.Tensor_mode"),
    "add_out": (lambda x, y: torch.add(x, y, alpha=2.0, out=x), True, None),
    "sub_out": (lambda x, y: torch.sub(y, x, alpha=1.5, out=x), True, None),
    "mul_out": (lambda x, y: torch.mul(x, y, out=x), True, None),
    "div_out": (lambda x, y: torch.div(x, y, rounding_mode="trunc", out=x), True, None),
}


@pytest.mark.parametrize("name", KEYWORD_CALLS)
def test_keyword_calls_match_cpu_through_the_fast_path(name):
    """alpha / rounding_mode / out= calls, repeated until their program serves them: same values as
    CPU torch, in-place and out= results are the target itself with its layout, its views see every
    update and its version counter moves as on CPU."""
    op, writes, fast_op = KEYWORD_CALLS[name]
    x, y = torch.randn(3, 4) * 4, torch.rand(3, 4) + 0.5
    xt, yt = x.to("tpu"), y.to("tpu")
    row, row_t = x[1], xt[1]
    for _ in range(4):
        want, got = op(x, y), op(xt, yt)
        torch.testing.assert_close(got.cpu(), want)
        assert (got is xt) == (want is x) == writes
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        torch.testing.assert_close(xt.cpu(), x)
        torch.testing.assert_close(row_t.cpu(), row)
        assert (xt._version, row_t._version) == (x._version, row._version)
    assert op_jit.stats().hits >= 2
    if fast_op is not None:
        assert fast_op in _fast_keyword_ops()


def test_fast_keyword_values_stay_apart():
    """Keyword values that compare equal but give other results (alpha 2 / 2.0 on ints, 0.0 / -0.0,
    rounding modes) get their own programs, each matching CPU torch."""
    x, y = torch.randn(3, 4) * 4, torch.rand(3, 4) + 0.5
    xt, yt = x.to("tpu"), y.to("tpu")
    ints = torch.arange(6).reshape(2, 3)
    for _ in range(3):
        for mode in ("floor", "trunc", None):
            torch.testing.assert_close(
                torch.div(xt, yt, rounding_mode=mode).cpu(), torch.div(x, y, rounding_mode=mode))
        for alpha in (-0.0, 0.0):
            torch.testing.assert_close(_signs(torch.add(-xt.abs(), yt, alpha=alpha).cpu()),
                                       _signs(torch.add(-x.abs(), y, alpha=alpha)))
        got, want = torch.add(ints.to("tpu"), ints.to("tpu"), alpha=2), torch.add(ints, ints, alpha=2)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
        with pytest.raises(RuntimeError, match="alpha"):
            torch.add(ints.to("tpu"), ints.to("tpu"), alpha=2.5)
    assert {"div.Tensor_mode", "add.Tensor"} <= _fast_keyword_ops()
