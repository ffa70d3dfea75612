import pyarrow as pa
import pytest

from pipelines.schema import CRITEO, DatasetSchema, criteo_schema


def test_criteo_columns_in_file_order():
    assert CRITEO.column_names == (
        ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    )
    assert len(CRITEO.dense) == 13 and len(CRITEO.sparse) == 26


def test_arrow_layout_single_and_multi_hot():
    schema = criteo_schema(multi_hot={"C3"}).arrow_schema()
    assert schema.field("label").type == pa.int8()
    assert schema.field("I1").type == pa.int64() and schema.field("I1").nullable
    assert schema.field("C1").type == pa.int64()
    assert schema.field("C3").type == pa.list_(pa.int64())
    assert CRITEO.arrow_schema(pa.float32()).field("label").type == pa.float32()
    with pytest.raises(ValueError, match="label type"):
        CRITEO.arrow_schema(pa.int64())


def test_schema_serves_other_datasets_and_validates():
    avazu = DatasetSchema(label="click", dense=(), sparse=("site_id", "app_id"), multi_hot=frozenset())
    assert avazu.column_names == ["click", "site_id", "app_id"]
    with pytest.raises(ValueError, match="not categorical"):
        criteo_schema(multi_hot={"I1"})
    with pytest.raises(ValueError, match="duplicated"):
        DatasetSchema(label="a", dense=("a",), sparse=("b",))
