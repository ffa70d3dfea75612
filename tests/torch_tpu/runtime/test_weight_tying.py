"""Module conversions keep Parameter objects as on CPU/CUDA: weight ties, ``p is q`` identity,
optimizers built before the move and shared submodules survive ``.to("tpu")``, ``.cpu()``,
``.tpu()``, ``load_state_dict`` and ``deepcopy``; tied models train on tpu exactly as on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tpu  # noqa: F401


class TinyGPT(nn.Module):
    """GPT-2 shaped, small enough for the default run: token + position embeddings, two pre-norm
    residual MLP blocks, a final LayerNorm and an LM head tied to the token embedding."""

    def __init__(self, vocab: int = 32, dim: int = 16, blocks: int = 2, context: int = 8) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


class TwoTower(nn.Module):
    """A user tower and an item tower sharing one item table (the user tower pools the user's
    history of items from it)."""

    def __init__(self, items: int = 20, users: int = 10, dim: int = 8) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(items, dim, mode="mean")
        self.user_tower = nn.ModuleDict({"users": nn.Embedding(users, dim), "history": self.items,
                                         "mlp": nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, dim))})
        self.item_tower = nn.ModuleDict({"table": self.items, "mlp": nn.Sequential(nn.Linear(dim, dim), nn.Tanh())})

    def forward(self, users: torch.Tensor, history: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u = self.user_tower
        user = u["mlp"](torch.cat([u["users"](users), u["history"](history)], dim=1))
        item = self.item_tower["mlp"](self.item_tower["table"](items[:, None]))
        return (user * item).sum(1)


def _tied_pair() -> nn.Module:
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6))
    model[1].weight = model[0].weight
    return model


_CONVERSIONS = {
    "to(tpu)": lambda m: m.to("tpu"),
    "to(device=tpu, dtype=float64)": lambda m: m.to(device="tpu", dtype=torch.float64),
    "tpu()": lambda m: m.tpu(),
    "to_empty(device=tpu)": lambda m: m.to_empty(device="tpu"),
    "to(tpu) then cpu()": lambda m: m.to("tpu").cpu(),
    "to(tpu) then to(cpu) then tpu()": lambda m: m.to("tpu").to("cpu").tpu(),
    "to(tpu) then half()": lambda m: m.to("tpu").half(),
}


@pytest.mark.parametrize("name", sorted(_CONVERSIONS))
def test_conversions_keep_ties_identity_and_grads(name):
    model = _tied_pair()
    weight, bias = model[0].weight, model[1].bias
    model(torch.tensor([1, 2])).sum().backward()
    _CONVERSIONS[name](model)
    assert model[0].weight is weight and model[1].weight is weight and model[1].bias is bias
    assert isinstance(weight, nn.Parameter) and weight.requires_grad
    assert weight.grad is not None and weight.grad.device == weight.device
    assert [p for p in model.parameters()] == [weight, bias]


def test_optimizer_built_before_the_move_updates_the_model():
    torch.manual_seed(0)
    model = _tied_pair()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.to("tpu")
    ids = torch.tensor([1, 2, 3])
    model(ids.to("tpu")).square().sum().backward()
    optimizer.step()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(ids).square().sum().backward()
    ref_optimizer.step()
    torch.testing.assert_close(model[0].weight.cpu(), reference[0].weight)
    assert model[1].weight is model[0].weight


def test_shared_submodule_stays_shared():
    shared = nn.Linear(3, 3)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared, nn.ReLU())})
    model.to("tpu")
    assert model["a"] is model["b"][0] and model["a"].weight.device.type == "tpu"


def test_load_state_dict_and_deepcopy_keep_ties():
    model = _tied_pair().to("tpu")
    weight = model[0].weight
    source = _tied_pair()
    model.load_state_dict(source.state_dict())
    assert model[0].weight is weight and model[1].weight is weight
    torch.testing.assert_close(weight.cpu(), source[0].weight.detach())
    clone = copy.deepcopy(model)
    assert clone[0].weight is clone[1].weight and clone[0].weight is not weight
    assert clone[0].weight.device.type == "tpu" and isinstance(clone[0].weight, nn.Parameter)


def test_future_overwrite_flag_is_still_honoured():
    model = _tied_pair()
    weight = model[0].weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to("tpu")
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert model[0].weight is not weight  # what torch does on CPU/CUDA with the flag set


def _train(model: nn.Module, batches: list[tuple], device: str) -> tuple[nn.Module, list[dict]]:
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for inputs, target in batches:
        optimizer.zero_grad()
        out = model(*(x.to(device) for x in inputs))
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.to(device).reshape(-1)) \
            if out.dim() == 3 else nn.functional.mse_loss(out, target.to(device))
        loss.backward()
        grads.append({n: p.grad.detach().cpu() for n, p in model.named_parameters()})
        optimizer.step()
    return model, grads


def _assert_trains_as_on_cpu(make: callable, batches: list[tuple]) -> None:
    torch.manual_seed(0)
    cpu_model = make()
    tpu_model = copy.deepcopy(cpu_model)
    cpu_model, cpu_grads = _train(cpu_model, batches, "cpu")
    tpu_model, tpu_grads = _train(tpu_model, batches, "tpu")
    for step_cpu, step_tpu in zip(cpu_grads, tpu_grads):
        assert step_cpu.keys() == step_tpu.keys()
        for name in step_cpu:
            torch.testing.assert_close(step_tpu[name], step_cpu[name], rtol=1e-4, atol=1e-5, msg=name)
    for (name, p_cpu), (_, p_tpu) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_tiny_gpt_with_tied_head_trains_as_on_cpu():
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, 32, (2, 8), generator=generator),), torch.randint(0, 32, (2, 8), generator=generator))
               for _ in range(3)]
    _assert_trains_as_on_cpu(TinyGPT, batches)
    model = TinyGPT().to("tpu")
    assert model.head.weight is model.tokens.weight


def test_two_tower_model_sharing_an_item_table_trains_as_on_cpu():
    generator = torch.Generator().manual_seed(2)
    batches = [((torch.randint(0, 10, (4,), generator=generator), torch.randint(0, 20, (4, 3), generator=generator),
                 torch.randint(0, 20, (4,), generator=generator)), torch.rand(4, generator=generator))
               for _ in range(3)]
    _assert_trains_as_on_cpu(TwoTower, batches)
    model = TwoTower().to("tpu")
    assert model.user_tower["history"].weight is model.item_tower["table"].weight
    assert len(list(model.parameters())) == len(list(TwoTower().parameters()))


@pytest.mark.parametrize("cls, args, shape", [
    (torch.nn.LazyLinear, (3,), (2, 5)), (torch.nn.LazyConv1d, (3, 2), (2, 4, 3)),
    (torch.nn.LazyBatchNorm1d, (), (4, 5)),
])
def test_lazy_modules_moved_to_tpu_initialise_there_like_cpu(cls, args, shape):
    """A lazy module's uninitialised tensors stay lazy through .to("tpu") (they cannot become tpu
    tensors while empty), materialise on the first forward from the same RNG draws as on CPU,
    and land on the device with the module's other tensors."""
    x = torch.randn(shape)
    on_cpu, on_tpu = cls(*args), cls(*args).to("tpu")
    torch.manual_seed(1)
    expected = on_cpu(x)
    torch.manual_seed(1)
    actual = on_tpu(x.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected)
    assert {t.device.type for t in (*on_tpu.parameters(), *on_tpu.buffers())} == {"tpu"}
    actual.sum().backward()
    expected.sum().backward()
    for p, q in zip(on_tpu.parameters(), on_cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad)
