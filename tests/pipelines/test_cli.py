import pyarrow.parquet as pq

from pipelines.synthetic import SyntheticConfig
from tests.pipelines.reference import reference_rows, sample_fields, write_tsv
from torchrec_tpu.cli import main as cli_main


def _run(*argv: str) -> int:
    return cli_main(["data", *argv])


def test_convert_csv_and_tsv(sample_csv, tmp_path, capsys):
    assert _run("convert", str(sample_csv), "-o", str(tmp_path / "a"), "--no-progress") == 0
    assert "read 200 rows, wrote 200" in capsys.readouterr().out
    assert pq.read_table(tmp_path / "a").to_pylist() == reference_rows(sample_csv)

    fields = sample_fields(sample_csv)
    fields[3][7] = "x"  # I7 of line 4
    tsv = write_tsv(fields, tmp_path / "day_0.txt")
    assert _run("convert", str(tsv), "-o", str(tmp_path / "b"), "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torchrec-tpu data convert: error: {tsv}:4: column I7")
    assert "(--on-bad-row skip counts and skips such rows)" in err
    argv = ["convert", str(tsv), "-o", str(tmp_path / "c"), "--format", "tsv", "--on-bad-row", "skip"]
    assert _run(*argv, "--no-progress") == 0
    out = capsys.readouterr().out
    assert "wrote 199" in out and "skipped 1 malformed rows" in out and f"{tsv}:4" in out


def test_generate_matches_library_config(tmp_path, capsys):
    argv = ["generate", "-o", str(tmp_path), "--rows", "1000", "--seed", "3", "--max-cardinality", "64"]
    assert _run(*argv, "--multi-hot", "C5", "--row-group-size", "256", "--no-progress") == 0
    table = pq.read_table(tmp_path)
    config = SyntheticConfig(num_rows=1000, seed=3, max_cardinality=64, multi_hot=("C5",))
    assert table.num_rows == 1000 and table.schema == config.schema.arrow_schema()
    assert ",".join(map(str, config.table_sizes)) in capsys.readouterr().out
    assert _run("generate", "-o", str(tmp_path / "bad"), "--multi-hot", "I1", "--no-progress") == 2
    assert "torchrec-tpu data generate: error: --multi-hot I1: I1 not categorical" in capsys.readouterr().err


def test_generate_multi_hot_sizes_writes_exactly_k_ids_per_row(tmp_path, capsys):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq


    sizes = ",".join(str(1 + i % 3) for i in range(26))
    assert cli_main(["data", "generate", "-o", str(tmp_path / "mh"), "--rows", "300", "--rows-per-file", "100",
                     "--multi-hot-sizes", sizes, "--no-progress"]) == 0
    table = pq.read_table(sorted((tmp_path / "mh").glob("*.parquet"))[0])
    for i in range(26):
        column = table.column(f"C{i + 1}")
        k = 1 + i % 3
        if k == 1:
            assert column.type == "int64"
        else:
            lengths = set(pc.list_value_length(column).drop_null().to_pylist())
            assert k in lengths and lengths <= {0, k}  # exactly k ids, or missing (empty)
    assert cli_main(["data", "generate", "-o", str(tmp_path / "bad"), "--multi-hot-sizes", "2,3"]) == 2
    assert "needs one size >= 1 per categorical column (26)" in capsys.readouterr().err


def test_convert_off_a_terminal_says_what_it_reads_and_how_far_it_is(sample_csv, tmp_path, capsys, monkeypatch):
    """Not on a terminal (no bar): a start line, then progress lines with rows, rows/s and ETA
    (every $TORCHREC_TPU_PROGRESS_SECONDS; 0 here: after every block read), the last at 100%."""
    import re

    monkeypatch.setenv("TORCHREC_TPU_PROGRESS_SECONDS", "0")
    tsv = write_tsv(sample_fields(sample_csv) * 6, tmp_path / "day_0.txt")
    output = tmp_path / "out"
    assert _run("convert", str(tsv), "-o", str(output)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"convert: reading 1 file(s), {tsv.stat().st_size:,} bytes, into {output}"
    progress = [line for line in lines[1:] if line.startswith("convert: ")]
    assert progress and all(re.fullmatch(r"convert: [0-9,]+ rows \(\d+%\)  [0-9,]+ rows/s  ETA (\?|\d+s)", line)
                            for line in progress), progress
    assert progress[-1].startswith("convert: 1,200 rows (100%)")
    assert lines[-1] == "read 1,200 rows, wrote 1,200 to 1 Parquet files, skipped 0 malformed rows"
