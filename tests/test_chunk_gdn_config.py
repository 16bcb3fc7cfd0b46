"""GDNKernelConfig's per-call choices (no kernels run): state columns per scan program, pipeline depth."""
import pytest

from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig


def test_scan_columns_follow_the_program_count():
    config = GDNKernelConfig()  # 32 columns; 16 below 264 programs; the many-sequence switch off
    assert config.scan_block_v_for(num_seqs=8, value_heads=16, value_dim=128) == 32     # 512 programs
    assert config.scan_block_v_for(num_seqs=4, value_heads=16, value_dim=128) == 16     # 256 < 264
    assert config.scan_block_v_for(num_seqs=500, value_heads=16, value_dim=128) == 32
    assert config.scan_block_v_for(num_seqs=1, value_heads=4, value_dim=8) == 8         # never above V
    many = GDNKernelConfig(many_seqs_scan_block_v=64, scan_many_programs=1024)
    assert many.scan_block_v_for(num_seqs=32, value_heads=16, value_dim=128) == 64      # 1024 programs at 64
    assert many.scan_block_v_for(num_seqs=31, value_heads=16, value_dim=128) == 32
    assert many.scan_block_v_for(num_seqs=1, value_heads=16, value_dim=128) == 16


def test_scan_stages_fit_shared_memory():
    """fp32 scans at K=V=128 fit the H200's 227 KiB of shared memory only at 1 stage (NOTES_gdn.md), whatever
    the 16-bit default; an explicit depth overrides both."""
    for config in (GDNKernelConfig(), GDNKernelConfig(scan_warps=4), GDNKernelConfig(scan_num_stages=0)):
        assert config.scan_stages_for(4) == 1
        assert config.scan_stages_for(2) >= 1
    assert GDNKernelConfig(scan_num_stages=3).scan_stages_for(2) == 3


@pytest.mark.parametrize("field, value", [("bwd_qk_block_k", 24), ("wy_kkt_block_k", 8), ("wy_kkt_block_k", 0)])
def test_bad_key_blocks_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        GDNKernelConfig(**{field: value})
