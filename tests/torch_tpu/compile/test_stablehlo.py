"""StableHLO export: the API returns the program text; TORCH_TPU_DUMP_HLO writes one file per graph."""

import pytest
import torch

import torch_tpu.compile as tc


def _f(x, w):
    return torch.tanh(x @ w).sum(dim=1)


def test_stablehlo_text_names_the_ops():
    torch.compile(_f, backend="tpu", dynamic=False)(torch.randn(3, 4), torch.randn(4, 5))
    (graph,) = tc.compiled_graphs()
    text = graph.stablehlo()
    assert "func.func public @main" in text
    assert "stablehlo.dot_general" in text and "stablehlo.tanh" in text
    assert "tensor<3x4xf32>" in text and "tensor<3xf32>" in text


def test_env_var_dumps_each_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TPU_DUMP_HLO", str(tmp_path))
    x = torch.randn(3, 4, requires_grad=True)
    torch.compile(_f, backend="tpu", dynamic=False)(x, torch.randn(4, 5)).sum().backward()
    files = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.stablehlo.mlir"))
    assert files == ["backward", "forward"]
    for path in tmp_path.iterdir():
        assert "stablehlo." in path.read_text()


def test_env_var_naming_a_file_is_refused_naming_the_variable(tmp_path, monkeypatch):
    # it failed inside compilation with the OS error alone (FileExistsError on the path)
    taken = tmp_path / "a_file"
    taken.write_text("")
    monkeypatch.setenv("TORCH_TPU_DUMP_HLO", str(taken))
    with pytest.raises(Exception, match=f"TORCH_TPU_DUMP_HLO='{taken}': expected a folder") as info:
        torch.compile(_f, backend="tpu", dynamic=False)(torch.randn(2, 4), torch.randn(4, 5))
    assert isinstance(getattr(info.value, "inner_exception", info.value), ValueError)  # (Dynamo wraps it)
