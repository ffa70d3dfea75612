import pyarrow as pa
import pytest

from pipelines.text_reader import CSV, BadRowError, TextReader
from tests.pipelines.reference import parse_reference_row, sample_fields, write_tsv


def _corrupt(fields: list[str], kind: str) -> list[str]:
    bad = list(fields)
    if kind == "too_few_columns":
        return bad[:-1]
    if kind == "too_many_columns":
        return bad + ["05db9164"]
    if kind == "non_numeric_integer":
        bad[4] = "abc"  # I4
    elif kind == "fractional_integer":
        bad[1] = "2.5"  # I1
    elif kind == "non_hex_categorical":
        bad[20] = "zz12"  # C7
    elif kind == "bad_label":
        bad[0] = "2"
    elif kind == "blank_line":
        return [""]
    return bad


# kind -> (column named in the message or None, message fragment)
KINDS = {
    "too_few_columns": (None, "expected 40 columns, got 39"),
    "too_many_columns": (None, "expected 40 columns, got 41"),
    "non_numeric_integer": ("I4", "expected an integer, got 'abc'"),
    "fractional_integer": ("I1", "expected an integer, got '2.5'"),
    "non_hex_categorical": ("C7", "expected a hex id"),
    "bad_label": ("label", "expected a 0/1 label, got '2'"),
    "blank_line": ("label", "expected a 0/1 label, got None"),
}
BAD_INDEX = 3  # 0-based data row -> line 4 of a headerless TSV


@pytest.fixture()
def rows(sample_csv):
    return sample_fields(sample_csv)[:10]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_error_policy_names_file_line_and_column(kind, rows, tmp_path):
    rows[BAD_INDEX] = _corrupt(rows[BAD_INDEX], kind)
    path = write_tsv(rows, tmp_path / "day_0")
    column, fragment = KINDS[kind]
    with pytest.raises(BadRowError) as raised:
        list(TextReader(path, on_bad_row="error"))
    message = str(raised.value)
    assert message.startswith(f"{path}:{BAD_INDEX + 1}: ")
    assert fragment in message
    if column is not None:
        assert f"column {column}:" in message


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_skip_policy_counts_and_keeps_every_good_row(kind, rows, tmp_path):
    good = [parse_reference_row(f) for i, f in enumerate(rows) if i != BAD_INDEX]
    rows[BAD_INDEX] = _corrupt(rows[BAD_INDEX], kind)
    path = write_tsv(rows, tmp_path / "day_0")
    reader = TextReader(path, on_bad_row="skip")
    assert pa.Table.from_batches(list(reader)).to_pylist() == good
    stats = reader.stats
    assert (stats.rows_read, stats.rows_accepted, stats.rows_skipped) == (10, 9, 1)
    assert [b.line for b in stats.bad_rows] == [BAD_INDEX + 1]
    assert KINDS[kind][1] in stats.bad_rows[0].reason


def test_line_numbers_across_blocks_and_header(sample_csv, tmp_path):
    """Rows dropped by the CSV parser earlier in the file must not shift later line numbers."""
    header = sample_csv.read_text().splitlines()[0]
    fields = sample_fields(sample_csv)
    fields[2] = _corrupt(fields[2], "too_few_columns")  # line 4 (after the header)
    fields[5] = _corrupt(fields[5], "too_many_columns")  # line 7
    fields[150] = _corrupt(fields[150], "non_hex_categorical")  # line 152
    path = tmp_path / "dirty.csv"
    path.write_text(header + "\n" + "".join(",".join(f) + "\n" for f in fields))
    reader = TextReader(path, text_format=CSV, on_bad_row="skip", block_size=2048)
    kept = sum(b.num_rows for b in reader)
    assert kept == 197 and reader.stats.rows_skipped == 3 and reader.stats.rows_read == 200
    assert sorted(b.line for b in reader.stats.bad_rows) == [4, 7, 152]
    with pytest.raises(BadRowError, match=r"dirty.csv:4: expected 40 columns, got 39"):
        list(TextReader(path, on_bad_row="error", block_size=2048))
    fields[2], fields[5] = sample_fields(sample_csv)[2], sample_fields(sample_csv)[5]
    path.write_text(header + "\n" + "".join(",".join(f) + "\n" for f in fields))
    with pytest.raises(BadRowError, match=r"dirty.csv:152: column C7"):
        list(TextReader(path, on_bad_row="error", block_size=2048))


def test_unknown_policy_rejected(sample_csv):
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        TextReader(sample_csv, on_bad_row="ignore")
