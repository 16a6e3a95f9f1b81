"""The launch tables shipped as data: the FP8 GEMM table loads into the configs and split-K rows the GEMMs use, a
malformed entry is refused naming the file, entry and key, and both tables read through one loader."""

from __future__ import annotations

import json

import pytest

from batchgen.kernels.fp8 import gemm as fp8_gemm
from batchgen.kernels.fp8 import gemm_table
from batchgen.kernels.fp8.gemm import GemmConfig


def test_the_fp8_table_gives_the_gemms_their_measured_configs_and_split_k_rows():
    assert fp8_gemm.SHAPE_CONFIGS == {(6144, 4096): {32: GemmConfig(16, 32, 8, 4, 4)},
                                      (28672, 4096): {32: GemmConfig(32, 64, 8, 4, 4)}}
    assert fp8_gemm.SPLITK_SHAPE_ROWS == {(6144, 4096): 64, (4096, 4096): 64, (4096, 14336): 64}
    assert fp8_gemm.gemm_config(32, 6144, 4096, 132) == GemmConfig(16, 32, 8, 4, 4)
    assert fp8_gemm.gemm_config(64, 6144, 4096) == fp8_gemm.CONFIGS[64]  # above the shape's largest bucket
    entries = json.loads(gemm_table.TABLE_PATH.read_text())["entries"]
    assert all(e["us"] < e["baseline_us"] and e["device"] for e in entries)  # an entry only where it won


@pytest.mark.parametrize("change, message", [
    ({"kernel": "cutlass"}, "entry 0: key 'kernel' is 'cutlass', not 'triton' or 'splitk'"),
    ({"max_rows": 0}, "entry 0: key 'max_rows' is 0, not an int >= 1"),
    ({"config": {"block_m": 16}}, "entry 0: key 'config.block_n' is missing"),
    ({"config": None}, "entry 0: key 'config' is missing"),
    ({"speed": 1}, "entry 0: key 'speed' is not one of"),
])
def test_a_malformed_fp8_table_entry_is_refused_naming_file_entry_and_key(tmp_path, change, message):
    entries = json.loads(gemm_table.TABLE_PATH.read_text())["entries"][:1]
    entries[0] = {**entries[0], **change}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "test", "entries": entries}))
    with pytest.raises(ValueError, match=f"{path}: {message}".replace("(", r"\(").replace(")", r"\)")):
        gemm_table.load(GemmConfig, path)


def test_a_second_split_k_entry_for_one_shape_is_refused(tmp_path):
    entries = [e for e in json.loads(gemm_table.TABLE_PATH.read_text())["entries"] if e["kernel"] == "splitk"]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": entries + entries[:1]}))
    with pytest.raises(ValueError, match="split-K rows of shape .* are also an earlier entry's"):
        gemm_table.load(GemmConfig, path)


def test_a_file_that_is_not_a_table_is_named(tmp_path):
    from batchgen.kernels.launch_tables import read_entries

    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{path}: not a launch table"):
        read_entries(path)
