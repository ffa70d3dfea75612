"""``torch.Generator(device="tpu")``: a generator for the device's random ops, reproducible under
its own seed and state as CPU generators are, and independent of the global seed."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn

import torch_tpu  # noqa: F401


def _draws(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(3, generator=g, device="tpu"), torch.rand(2, 2, generator=g, device="tpu"),
            torch.empty(4, device="tpu").uniform_(generator=g), torch.randperm(6, generator=g, device="tpu"),
            torch.empty(4, device="tpu").bernoulli_(0.5, generator=g),
            torch.randint(0, 10, (5,), generator=g, device="tpu"), torch.empty(3, device="tpu").normal_(generator=g),
            torch.empty(3, device="tpu").exponential_(generator=g)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def test_a_tpu_generator_is_a_torch_generator_on_the_device():
    # it raised NotImplementedError (no getNewGenerator for PrivateUse1)
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0) and isinstance(g, torch.Generator)
    assert torch.Generator(device=torch.device("tpu", 0)).device.type == "tpu"
    assert type(torch.Generator()) is torch._C.Generator and torch.Generator("cpu").device.type == "cpu"
    assert isinstance(torch.default_generator, torch.Generator)
    with pytest.raises(RuntimeError, match="device index 1"):
        torch.Generator(device="tpu:1")


def test_the_same_seed_gives_the_same_values_and_the_stream_advances():
    g = torch.Generator(device="tpu")
    g.manual_seed(7)
    first = _draws(g)
    assert g.initial_seed() == 7
    g.manual_seed(7)
    assert _same(first, _draws(g))
    assert not torch.equal(_draws(g)[0].cpu(), first[0].cpu())
    other = torch.Generator(device="tpu").manual_seed(8)
    assert not torch.equal(torch.randn(3, generator=other, device="tpu").cpu(), first[0].cpu())


def test_get_and_set_state_replay_the_stream():
    g = torch.Generator(device="tpu").manual_seed(3)
    _draws(g)
    state = g.get_state()
    expected = _draws(g)
    g.set_state(state)
    assert _same(expected, _draws(g))
    clone = torch.Generator(device="tpu")
    clone.set_state(state)
    assert _same(expected, _draws(clone))
    g.seed()
    assert g.initial_seed() != 3


def test_an_explicit_generator_leaves_the_global_stream_alone():
    # the device ignored generator= before: draws came from (and advanced) the global key
    torch.manual_seed(11)
    expected = torch.randn(4, device="tpu").cpu()
    torch.manual_seed(11)
    torch.randn(4, generator=torch.Generator(device="tpu").manual_seed(5), device="tpu")
    assert torch.equal(torch.randn(4, device="tpu").cpu(), expected)


def _draws_after_seed(generator: torch.Generator | None) -> list[torch.Tensor]:
    """A seeded run's draws given ``generator`` (multinomial runs as a CPU fallback), then draws
    given none."""
    torch.manual_seed(13)
    given = [*_draws(generator), torch.multinomial(torch.ones(6, device="tpu"), 3, generator=generator)]
    return given + [torch.randn(3, device="tpu"), torch.multinomial(torch.ones(6, device="tpu"), 3)]


def test_the_default_generator_draws_from_and_advances_the_global_stream():
    # as CPU's torch.default_generator and CUDA's default_generators[0]: it drew from a private stream
    cpu = [torch.manual_seed(13), torch.randn(3, generator=torch.default_generator), torch.randn(3)]
    torch.manual_seed(13)
    assert torch.equal(cpu[1], torch.randn(3)) and torch.equal(cpu[2], torch.randn(3))
    assert _same(_draws_after_seed(torch.tpu.default_generators[0]), _draws_after_seed(None))


def test_init_functions_take_the_generator():
    g = torch.Generator(device="tpu")
    weights = []
    for _ in range(2):
        w = torch.empty(4, 3, device="tpu")
        nn.init.kaiming_uniform_(w, generator=g.manual_seed(1))
        weights.append(w.cpu())
    assert torch.equal(*weights)
    assert weights[0].abs().max() <= (6 / 3) ** 0.5  # kaiming_uniform's bound for fan_in 3


def test_cpu_generators_keep_working():
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.randn(3, generator=g), expected)
    assert pickle.loads(pickle.dumps(g)).initial_seed() == 0


_RANDOM_OPS = {
    "randn": lambda g: torch.randn(3, generator=g, device="tpu"),
    "rand": lambda g: torch.rand(3, generator=g, device="tpu"),
    "randint": lambda g: torch.randint(0, 10, (5,), generator=g, device="tpu"),
    "randperm": lambda g: torch.randperm(6, generator=g, device="tpu"),
    "normal_": lambda g: torch.empty(3, device="tpu").normal_(generator=g),
    "normal": lambda g: torch.normal(torch.zeros(3, device="tpu"), torch.ones(3, device="tpu"), generator=g),
    "uniform_": lambda g: torch.empty(3, device="tpu").uniform_(generator=g),
    "exponential_": lambda g: torch.empty(3, device="tpu").exponential_(generator=g),
    "random_": lambda g: torch.empty(3, device="tpu").random_(generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((4,), 0.5, device="tpu"), generator=g),
    "bernoulli_": lambda g: torch.empty(4, device="tpu").bernoulli_(0.5, generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(4, device="tpu"), 2, generator=g),
    "poisson": lambda g: torch.poisson(torch.ones(3, device="tpu"), generator=g),  # generator positional in aten
    "init.trunc_normal_": lambda g: nn.init.trunc_normal_(torch.empty(3, device="tpu"), generator=g),
}


@pytest.mark.parametrize("op", sorted(_RANDOM_OPS))
def test_a_cpu_generator_is_refused_as_cuda_refuses_it(op):
    # it was used: CUDA raises "Expected a 'cuda' device type for generator but found 'cpu'"
    make = _RANDOM_OPS[op]
    with pytest.raises(RuntimeError, match="Expected a 'tpu' device type for generator but found 'cpu'"):
        make(torch.Generator().manual_seed(0))
    draws = [make(torch.Generator(device="tpu").manual_seed(4)).cpu() for _ in range(2)]
    assert draws[0].device.type == "cpu" and torch.equal(*draws)  # a tpu generator: reproducible
