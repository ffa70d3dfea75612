import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.specs import FeatureSpec, TableSpec
from sparsecore.validation import feature_inputs

TABLES = {"t": TableSpec("t", 10, 4)}
FEATURES = [FeatureSpec("f", "t", 2, weighted=True), FeatureSpec("g", "t", 2, max_ids_per_sample=2)]


def _kjt(values, lengths, weights=None, keys=("f", "g")):
    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths),
                             weights=None if weights is None else torch.tensor(weights))


def test_splits_features_and_defaults_weights():
    out = feature_inputs(_kjt([1, 2, 3, 4, 5], [2, 1, 0, 2], [0.5, 1.0, 2.0, 1.0, 1.0]), FEATURES, TABLES)
    np.testing.assert_array_equal(out["f"].ids, [1, 2, 3])
    np.testing.assert_array_equal(out["f"].weights, [0.5, 1.0, 2.0])
    np.testing.assert_array_equal(out["g"].lengths, [0, 2])


@pytest.mark.parametrize("values, message", [
    ([1, 2, -1, 4, 5], r"feature 'f' \(table 't'\): id -1 is outside the table's 10 rows \[0, 10\) \(position 2"),
    ([1, 2, 3, 10, 5], r"feature 'g' \(table 't'\): id 10 is outside the table's 10 rows"),
    ([1, 2, 3, 2**32 + 3, 5], r"feature 'g' \(table 't'\): id 4294967299 is outside"),
    ([1, 2, 3, 4, 2**63 - 1], r"feature 'g' \(table 't'\): id 9223372036854775807 is outside"),
    ([-2**63, 2, 3, 4, 5], r"feature 'f' \(table 't'\): id -9223372036854775808 is outside")])
def test_out_of_range_ids_raise_naming_feature_and_table(values, message):
    with pytest.raises(ValueError, match=message):
        feature_inputs(_kjt(values, [2, 1, 0, 2], [1.0] * 5), FEATURES, TABLES)


def test_raw_id_features_take_any_int64_and_the_others_are_still_checked():
    kjt = _kjt([-5, 2**63 - 1, 10**12, 4, 5], [2, 1, 0, 2], [1.0] * 5)
    out = feature_inputs(kjt, FEATURES, TABLES, raw_ids={"f"})
    np.testing.assert_array_equal(out["f"].ids, [-5, 2**63 - 1, 10**12])
    with pytest.raises(ValueError, match=r"feature 'g' \(table 't'\): id 10 is outside"):
        feature_inputs(_kjt([-5, 1, 2, 10, 5], [2, 1, 0, 2], [1.0] * 5), FEATURES, TABLES, raw_ids={"f"})


def test_hash_and_clip_policies():
    kjt = _kjt([1, -1, 13, 4, 25], [2, 1, 0, 2], [1.0] * 5)
    np.testing.assert_array_equal(feature_inputs(kjt, FEATURES, TABLES, "hash")["f"].ids, [1, 9, 3])
    np.testing.assert_array_equal(feature_inputs(kjt, FEATURES, TABLES, "clip")["g"].ids, [4, 9])
    with pytest.raises(ValueError, match="id_policy"):
        feature_inputs(kjt, FEATURES, TABLES, "wrap")


@pytest.mark.parametrize("build, message", [
    (lambda: _kjt([1, 2, 3], [2, 1, 0, 2], [1.0] * 3),
     r"feature 'g': lengths sum to 2 \(5 over all features \['f', 'g'\]\) but the KJT has 3 values"),
    (lambda: _kjt([1, 2, 3, 4, 5, 6], [2, 1, 0, 2], [1.0] * 6),
     r"feature 'g': lengths sum to 2 \(5 over all features .*\) but the KJT has 6 values"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 1, 3, -1], [1.0] * 5), r"feature 'g': sample 1 has length -1"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 1, 0, 2], [1.0] * 4), "weights shape"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 1, 0, 2], keys=("f", "h")),
     r"the KJT has no feature 'g'; its features are \['f', 'h'\]"),
    (lambda: _kjt([1, 2, 3], [1, 0, 1, 0, 1, 0], [1.0] * 3, keys=("f", "g", "h")),
     r"KJT keys \['h'\] are not features of these tables"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 1, 0, 2]), "'f' .*weighted but the KJT carries no weights"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 0, 0, 3], [1.0] * 5), "'g'.*3 ids, above max_ids_per_sample 2"),
    (lambda: _kjt([1, 2, 3, 4, 5], [2, 1, 0, 2], [1.0, float("nan"), 1.0, 1.0, 1.0]), "NaN"),
])
def test_bad_input_is_rejected_on_the_host(build, message):
    with pytest.raises(ValueError, match=message):
        feature_inputs(build(), FEATURES, TABLES)


def test_batch_size_mismatch():
    kjt = KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0, 0, 0]),
                            weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"feature 'f': lengths for 3 samples, expected 2 \(the batch size\)"):
        feature_inputs(kjt, FEATURES, TABLES)
