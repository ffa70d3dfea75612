"""Behaviours PyTorch's third-party-device suite (the "openreg" PrivateUse1 backend's tests) expects,
checked on "tpu" against CPU torch or torch's documented semantics."""

from __future__ import annotations

import copy
import multiprocessing
import warnings

import pytest
import torch

import torch_tpu  # noqa: F401

aten = torch.ops.aten
pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")


# --- storages -------------------------------------------------------------------------------------


def test_storage_methods_are_generated():
    for cls in (torch.TypedStorage, torch.UntypedStorage):
        assert hasattr(cls, "is_tpu") and hasattr(cls, "tpu")
    assert not torch.empty(2).untyped_storage().is_tpu


def test_tensor_storage_is_a_typed_storage_on_the_device():
    t = torch.randn(4, 4, device="tpu")
    storage = t.storage()
    assert isinstance(storage, torch.TypedStorage) and storage.is_tpu
    assert storage.device == torch.device("tpu:0") and storage.dtype == torch.float32
    assert storage.size() == t.numel() and t.untyped_storage().nbytes() == 64
    assert storage.type() == "torch.storage.TypedStorage"
    assert torch.serialization.location_tag(t.untyped_storage()) == "tpu:0"
    t.resize_(2, 2, 2, 2)
    assert t.storage().size() == 16  # a shrinking resize_ keeps the storage


def test_set_from_a_typed_storage_views_it():
    x = torch.randn(3, 4, device="tpu")
    y = torch.empty(3, 4, device="tpu")
    y.set_(x.storage(), 0, y.size())
    torch.testing.assert_close(y.cpu(), x.cpu(), rtol=0, atol=0)
    x.add_(1)  # a view of x's storage, not a copy
    torch.testing.assert_close(y.cpu(), x.cpu(), rtol=0, atol=0)


def test_host_storage_to_tpu_keeps_the_bytes():
    x = torch.arange(6, dtype=torch.float32)
    untyped = x.untyped_storage().tpu()
    assert untyped.is_tpu and untyped.nbytes() == 24
    assert untyped.tpu() is untyped
    y = torch.empty(0, device="tpu").set_(untyped, 0, (2, 3))
    torch.testing.assert_close(y.cpu(), x.reshape(2, 3), rtol=0, atol=0)
    typed = x.storage().tpu()
    assert typed.is_tpu and typed.dtype == torch.float32 and typed.size() == 6
    z = torch.empty(0, device="tpu").set_(typed)
    torch.testing.assert_close(z.cpu(), x, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="index 1"):
        x.untyped_storage().tpu(1)


def test_untyped_storage_cpu_copies_the_bytes():
    x = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    host = x.to("tpu").untyped_storage().cpu()
    assert host.device.type == "cpu"
    assert bytes(host) == bytes(x.untyped_storage())


def test_tpu_storage_copies_and_saves_like_a_torch_storage(tmp_path):
    t = torch.arange(4.0, device="tpu")
    storage = t.untyped_storage()
    host_bytes = torch.arange(4.0).untyped_storage().tolist()
    assert storage.tolist() == host_bytes and list(storage) == host_bytes and storage[4] == host_bytes[4]
    copies = [storage.clone(), copy.deepcopy(storage)]
    torch.save({"storage": storage, "typed": t.storage()}, tmp_path / "s.pt")
    t.add_(1)  # the copies and the file keep the old bytes
    for c in copies:
        assert c.is_tpu and c.tolist() == host_bytes
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    assert loaded["storage"].is_tpu and loaded["storage"].tolist() == host_bytes
    assert loaded["typed"].is_tpu and loaded["typed"].tolist() == [0.0, 1.0, 2.0, 3.0]


# --- factories ------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [torch.triu_indices, torch.tril_indices])
@pytest.mark.parametrize(("row", "col", "offset"), [(3, 3, 0), (4, 3, 1), (3, 5, -1), (0, 3, 0), (2, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_triangle_indices_match_cpu(factory, row, col, offset, dtype):
    got = factory(row, col, offset, device="tpu", dtype=dtype)
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), factory(row, col, offset, dtype=dtype), rtol=0, atol=0)


_LAYOUTS = {
    "contiguous(channels_last)": lambda t: t.contiguous(memory_format=torch.channels_last),
    "to(memory_format=channels_last)": lambda t: t.to(memory_format=torch.channels_last),
    "clone keeps channels_last": lambda t: t.contiguous(memory_format=torch.channels_last).clone(),
    "clone(contiguous_format)": lambda t: t.contiguous(memory_format=torch.channels_last).clone(
        memory_format=torch.contiguous_format),
    "dtype cast keeps channels_last": lambda t: t.contiguous(memory_format=torch.channels_last).double(),
    "clone of a permute": lambda t: t.permute(0, 2, 3, 1).clone(),
    "clone of a strided slice": lambda t: t[:, :, ::2].clone(),
    "channels_last_3d": lambda t: t.unsqueeze(2).contiguous(memory_format=torch.channels_last_3d),
    "to cpu keeps channels_last": lambda t: t.contiguous(memory_format=torch.channels_last).to("cpu"),
    "zeros_like keeps channels_last": lambda t: torch.zeros_like(t.contiguous(memory_format=torch.channels_last)),
    "full_like of a permute": lambda t: torch.full_like(t.permute(0, 2, 1, 3), 2.5),
    "ones_like(int32, channels_last)": lambda t: torch.ones_like(t, dtype=torch.int32,
                                                                 memory_format=torch.channels_last),
}


@pytest.mark.parametrize("name", sorted(_LAYOUTS))
def test_copies_take_the_memory_format_cpu_gives_them(name):
    fn = _LAYOUTS[name]
    host = torch.randn(2, 3, 4, 5)
    expected, got = fn(host), fn(host.to("tpu"))
    assert got.stride() == expected.stride()
    assert got.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
        memory_format=torch.channels_last)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


def test_quantizing_on_tpu_says_quantized_values_stay_on_cpu():
    with pytest.raises(NotImplementedError, match="quantized"):
        torch.quantize_per_tensor(torch.randn(3, 4, device="tpu"), 0.1, 10, torch.qint8)


# --- attention ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "bias", "causal"), [
    ((2, 3, 5, 4), None, False), ((2, 3, 5, 4), "float", False), ((2, 3, 5, 4), "bool", True),
    ((3, 6, 4), None, True),
])
def test_overrideable_attention_matches_cpu_sdpa_and_its_gradients(shape, bias, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    n = shape[-2]
    mask = None
    if bias == "float":
        mask = torch.randn(*shape[:-2], n, n, dtype=torch.float64, requires_grad=True)
    elif bias == "bool":
        mask = torch.rand(*shape[:-2], n, n) > 0.3
        mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    grad = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad)

    def on_tpu(t):
        return None if t is None else t.detach().float().to("tpu") if t.is_floating_point() else t.to("tpu")

    qt, kt, vt, bt = map(on_tpu, (q, k, v, mask))
    outs = aten._scaled_dot_product_fused_attention_overrideable(qt, kt, vt, attn_bias=bt, is_causal=causal)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(outs[0].cpu().double(), expected.detach(), **tol)
    assert outs[1].dtype == torch.float32 and outs[1].shape == (*(shape[:-3] or (1,)), shape[-3], n)
    assert outs[4:6] == (n, n)
    grads = aten._scaled_dot_product_fused_attention_overrideable_backward(
        on_tpu(grad), qt, kt, vt, bt, [True] * 4, *outs[:6], dropout_p=0.0, is_causal=causal,
        philox_seed=outs[6], philox_offset=outs[7])
    wanted = (q.grad, k.grad, v.grad, mask.grad if bias == "float" else None)
    for got, want in zip(grads, wanted):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got.cpu().double(), want, **tol)


# --- random ---------------------------------------------------------------------------------------


def test_rng_state_all_round_trip():
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count()
    first = torch.randn(8, device="tpu").cpu()
    torch.tpu.set_rng_state_all(states)
    torch.testing.assert_close(torch.randn(8, device="tpu").cpu(), first, rtol=0, atol=0)


def _forked_child(queue) -> None:
    try:
        torch.tpu.init()
        error = ""
    except RuntimeError as e:
        error = str(e)
    torch.manual_seed(1234)  # must leave the device generator alone here
    queue.put((error, torch.tpu._is_in_bad_fork(), torch.tpu.initial_seed()))


def test_fork_after_the_backend_started_is_a_bad_fork():
    torch.tpu.manual_seed(7)
    torch.ones(2, device="tpu").sum().item()  # the JAX backend runs in this process
    assert not torch.tpu._is_in_bad_fork()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_forked_child, args=(queue,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # os.fork() in a multithreaded process
        child.start()
    error, bad_fork, seed = queue.get(timeout=120)
    child.join(timeout=120)
    assert "Cannot re-initialize tpu in forked subprocess" in error and "spawn" in error
    assert bad_fork and seed == 7
    torch.tpu.init()  # fine in the parent


# --- events and memory ----------------------------------------------------------------------------


def test_streams_and_events_are_torch_streams_and_events():
    stream = torch.tpu.Stream()
    assert isinstance(stream, torch.Stream) and stream.device == torch.device("tpu:0")
    assert stream == torch.accelerator.current_stream() == torch.tpu.current_stream()
    torch.accelerator.set_stream(stream)
    with stream:
        x = torch.ones(256, device="tpu") * 2
    event = stream.record_event()
    assert isinstance(event, torch.Event)
    event.synchronize()
    assert event.query() and stream.query()
    torch.testing.assert_close(x.cpu(), torch.full((256,), 2.0))
    with pytest.raises(RuntimeError, match="index 1"):
        torch.tpu.Stream("tpu:1")


def test_record_stream_is_accepted():
    x = torch.arange(4.0, device="tpu")
    y = x * 2
    y.record_stream(torch.tpu.current_stream())  # FSDP / pipelining code calls it as on CUDA
    y.record_stream(torch.Stream(device="tpu"))
    torch.testing.assert_close(y.cpu(), torch.arange(4.0) * 2)


def test_event_elapsed_time_needs_timing_events():
    start, end = torch.tpu.Event(), torch.tpu.Event()
    start.record()
    end.record()
    with pytest.raises(ValueError, match="enable_timing=True"):
        start.elapsed_time(end)
    timed = torch.tpu.Event(enable_timing=True)
    with pytest.raises(ValueError, match="recorded"):
        timed.elapsed_time(torch.tpu.Event(enable_timing=True))


def test_reserved_memory_and_mem_get_info():
    x = torch.ones(1 << 16, device="tpu")
    allocated = torch.tpu.memory_allocated()
    assert allocated >= x.numel() * 4
    assert torch.tpu.memory_reserved() >= allocated
    assert torch.tpu.max_memory_reserved() >= torch.tpu.memory_reserved()
    free, total = torch.tpu.mem_get_info()
    assert 0 <= free <= total and total > x.numel() * 4
    stats = torch.tpu.memory_stats()
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]


# --- torch.compile --------------------------------------------------------------------------------


def test_compiled_graph_returns_outputs_on_their_own_device():
    def fn(x):
        y = x + 1
        return y, y.cpu() * 2

    x = torch.randn(4, device="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_device, on_host = torch.compile(fn, backend="tpu", fullgraph=True)(x)
    expected = (x.cpu() + 1) * 2
    assert on_device.device.type == "tpu" and on_host.device.type == "cpu"
    torch.testing.assert_close(on_host, expected)
    torch.testing.assert_close(on_device.cpu(), x.cpu() + 1)


def test_dynamo_device_interface_answers_for_tpu():
    from torch._dynamo.device_interface import get_interface_for_device

    interface = get_interface_for_device("tpu")
    assert interface.current_device() == torch.tpu.current_device()
    assert interface.device_count() == torch.tpu.device_count() and interface.is_available()
    with interface.device(0):
        interface.synchronize()
    assert interface.exchange_device(0) == 0
    with pytest.raises(RuntimeError, match="index 1"):
        interface.set_device(1)
