"""PrefetchedBatches: input dist on a background thread, same training as without it."""

import threading

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.pipeline import PrefetchedBatches

from .reference import random_kjt, targets
from .single_rank import BATCH, sharded_ebc


def batches(count: int) -> list[Batch]:
    return [Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=random_kjt(BATCH, step),
                  labels=targets(BATCH, step)) for step in range(count)]


def train(ebc, stream) -> list[torch.Tensor]:
    outputs = []
    for batch in stream:
        out = ebc(batch.sparse_features).values()
        outputs.append(out.detach().clone())
        (0.5 * ((out - batch.labels) ** 2).sum()).backward()
    return outputs


def test_prefetched_training_equals_plain_and_runs_input_dist_off_thread():
    plain, piped = sharded_ebc("adagrad"), sharded_ebc("adagrad")
    threads = []
    original = piped.input_dist

    def recording_input_dist(kjt, group=None, **kwargs):
        threads.append(threading.current_thread().name)
        return original(kjt, group, **kwargs)

    piped.input_dist = recording_input_dist
    data = batches(5)
    expected = train(plain, data)
    for epoch in range(2):  # re-iterable: a fresh prefetch thread per pass
        got = train(piped, PrefetchedBatches(data, piped, torch.device("cpu"), depth=2))
        if epoch == 0:
            for e, g in zip(expected, got):
                assert torch.equal(e, g)
    main = threading.current_thread().name
    assert len(threads) == 10 and main not in threads  # every input dist ran ahead, off the step's thread
    train(plain, data)
    for name, weight in plain.unsharded_weights().items():
        assert torch.equal(weight, piped.unsharded_weights()[name])


def test_loader_errors_surface_in_the_consumer_naming_the_feature():
    ebc = sharded_ebc("sgd")
    good = batches(1)[0]
    kjt = good.sparse_features
    values = kjt.values().clone()
    values[0] = 1000
    bad = Batch(good.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()),
                good.labels)
    stream = iter(PrefetchedBatches([good, bad], ebc, torch.device("cpu")))
    next(stream)
    with pytest.raises(ValueError, match="feature 'user'.*1000"):
        next(stream)


def test_stopping_early_ends_the_thread():
    ebc = sharded_ebc("sgd")
    stream = iter(PrefetchedBatches(batches(6), ebc, torch.device("cpu"), depth=1))
    before = set(threading.enumerate())
    next(stream)
    assert len(set(threading.enumerate()) - before) == 1
    stream.close()
    assert set(threading.enumerate()) - before == set()


def test_a_prefetched_kjt_hands_its_input_dist_to_its_owner_only():
    owner, other = sharded_ebc("sgd"), sharded_ebc("sgd")
    kjt = batches(1)[0].sparse_features
    calls = []
    original = owner.input_dist
    owner.input_dist = lambda k, group=None, **kw: calls.append(k) or original(k, group, **kw)
    ahead = owner.prefetch(kjt)
    assert ahead.to(torch.device("cpu")) is ahead  # Batch.to in the loop keeps the hand-off
    with torch.no_grad():
        assert torch.equal(owner(ahead).values(), other(kjt).values())
        assert torch.equal(other(ahead).values(), other(kjt).values())  # other EBCs run their own dist
    assert len(calls) == 1  # the owner's forward started from the prefetched dist
