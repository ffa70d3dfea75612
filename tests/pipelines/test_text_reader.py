import gzip

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.schema import CRITEO
from pipelines.text_parsing import parse_hex, parse_int
from pipelines.text_reader import CSV, TSV, TextReader, detect_format
from tests.pipelines.reference import reference_rows, sample_fields, write_tsv


def _read_all(reader: TextReader) -> list[dict]:
    return pa.Table.from_batches(list(reader)).to_pylist()


def test_csv_sample_rows_checked_by_hand(sample_csv):
    rows = _read_all(TextReader(sample_csv))
    assert len(rows) == 200
    # Line 2 of the file: 0,,3,260.0,,17668.0,,,33.0,,,,0.0,,05db9164,08d6d899,...,c0d61a5c,,
    first = rows[0]
    assert first["label"] == 0
    assert [first[f"I{i}"] for i in range(1, 14)] == [
        None, 3, 260, None, 17668, None, None, 33, None, None, None, 0, None
    ]
    assert first["C1"] == 0x05DB9164 == 98275684
    assert first["C2"] == 0x08D6D899
    assert first["C24"] == 0xC0D61A5C
    assert first["C19"] is None and first["C20"] is None and first["C25"] is None
    # Line 3 holds the sentinel I2 = -1.
    assert rows[1]["I2"] == -1 and rows[1]["I6"] == 247
    # Line 9 is the first click: 1,19.0,10,30.0,...,e8b83407,2fede552
    click = rows[7]
    assert click["label"] == 1 and click["I1"] == 19 and click["I13"] == 2 and click["I12"] is None
    assert click["C25"] == 0xE8B83407 and click["C26"] == 0x2FEDE552
    assert click["C6"] is None


def test_csv_sample_matches_reference_parse(sample_csv):
    reader = TextReader(sample_csv)
    assert _read_all(reader) == reference_rows(sample_csv)
    assert reader.stats.rows_read == reader.stats.rows_accepted == 200
    assert reader.stats.rows_skipped == 0


def test_tsv_written_from_sample(sample_csv, tmp_path):
    fields = sample_fields(sample_csv)
    tsv = write_tsv(fields, tmp_path / "day_0")
    assert detect_format(tsv) == TSV and detect_format(sample_csv) == CSV
    # A small block size forces many batches through the streaming reader.
    rows = _read_all(TextReader(tsv, block_size=4096))
    assert rows == reference_rows(sample_csv)


def test_gzip_tsv_and_progress_counts_compressed_bytes(sample_csv, tmp_path):
    plain = write_tsv(sample_fields(sample_csv), tmp_path / "day_0")
    packed = tmp_path / "day_0.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    consumed = []
    rows = _read_all(TextReader(packed, on_progress=consumed.append))
    assert rows == reference_rows(sample_csv)
    assert sum(consumed) == packed.stat().st_size


def test_csv_header_must_match_schema(sample_csv, tmp_path):
    renamed = tmp_path / "renamed.csv"
    lines = sample_csv.read_text().splitlines(keepends=True)
    renamed.write_text(lines[0].replace("I5", "I5x") + "".join(lines[1:3]))
    with pytest.raises(ValueError, match=r"renamed.csv:1: header .* does not match"):
        list(TextReader(renamed))


def test_multi_hot_schema_rejected_for_text(sample_csv):
    with pytest.raises(ValueError, match="multi-hot"):
        TextReader(sample_csv, CRITEO.with_multi_hot({"C1"}))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 2**63 - 1)), max_size=40), st.booleans())
def test_parse_hex_equals_int_base_16(values, upper):
    texts = [None if v is None else (f"{v:X}" if upper else f"{v:x}") for v in values]
    parsed, malformed = parse_hex(pa.array(texts, pa.string()))
    assert not malformed.any()
    assert parsed.to_pylist() == [None if t is None else int(t, 16) for t in texts]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-(10**17), 10**17)), max_size=40))
def test_parse_int_accepts_integral_decimals(values):
    texts = [None if v is None else (f"{v}.0" if v % 2 else str(v)) for v in values]
    parsed, malformed = parse_int(pa.array(texts, pa.string()))
    assert not malformed.any()
    assert parsed.to_pylist() == values


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_parse_hex_fixed_width_mixed_and_sliced(offset):
    texts = ["05db9164", "0123456789abcdef0", "0b153874", None, "zz", "68fd1e64", "", "7", "c0d61a5c"]
    array = pa.array(texts, pa.string()).slice(offset)
    parsed, malformed = parse_hex(array)
    expected_malformed = [t is not None and (t == "" or len(t) > 16 or t == "zz") for t in texts]
    assert malformed.tolist() == expected_malformed[offset:]
    expected = [None if t is None or bad else int(t, 16) for t, bad in zip(texts, expected_malformed)]
    assert parsed.to_pylist() == expected[offset:]
    fixed = pa.array(["05db9164", None, "0b153874", "c0d61a5c"]).slice(offset % 2)
    assert parse_hex(fixed)[0].to_pylist() == [
        None if t is None else int(t, 16) for t in ["05db9164", None, "0b153874", "c0d61a5c"]
    ][offset % 2 :]


def test_parsers_flag_malformed_values_only():
    _, malformed = parse_hex(pa.array(["0a", "xyz", "8000000000000000", "7fffffffffffffff", None]))
    assert malformed.tolist() == [False, True, True, False, False]
    _, malformed = parse_int(pa.array(["12", "1.5", "abc", "-3", "1e3", None]))
    assert malformed.tolist() == [False, True, True, False, True, False]
