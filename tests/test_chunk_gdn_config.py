"""GDNKernelConfig's per-call choices (no kernels run): state columns per scan program, pipeline depth."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler.codegen.kernels.chunk_gdn import GDNKernelConfig


def test_scan_launch_follows_the_program_count():
    """(columns, warps, stages) of the scans for bf16 inputs at HV=16, V=128: 64 columns, halved while a call
    has fewer than 128 programs, 4 warps, 3 stages."""
    config = GDNKernelConfig()
    assert config.scan_launch_for(8, 16, 128, 2) == (64, 4, 3)      # 256 programs
    assert config.scan_launch_for(4, 16, 128, 2) == (64, 4, 3)      # 128
    assert config.scan_launch_for(3, 16, 128, 2) == (32, 4, 3)      # 96 at 64 columns, 192 at 32
    assert config.scan_launch_for(1, 32, 128, 2) == (32, 4, 3)      # 128 at 32
    assert config.scan_launch_for(1, 16, 128, 2) == (16, 4, 3)      # a lone root: 128 at 16
    assert config.scan_launch_for(1, 4, 128, 2) == (16, 4, 3)       # never below 16
    assert config.scan_launch_for(500, 16, 128, 2) == (64, 4, 3)
    assert config.scan_launch_for(1, 4, 8, 2)[0] == 8                # never above V
    assert config.scan_launch_for(1, 16, 128, 4) == (16, 4, 1)      # fp32: 1 stage
    assert GDNKernelConfig(scan_min_programs=0).scan_launch_for(1, 16, 128, 2) == (64, 4, 3)
    assert GDNKernelConfig(scan_block_v=32, scan_warps=2).scan_launch_for(8, 16, 128, 2) == (32, 2, 3)


def test_backward_scans_form_dv_local_at_full_width_over_long_sequences():
    """A backward scan launch forms dv_local itself only at full width and with a sequence of at least
    scan_local_dv_min_chunks chunks; otherwise it reads the chunk-parallel kernel's buffer."""
    config = GDNKernelConfig()
    assert config.scan_forms_dv_local(8, 120, 16, 128, 2)           # 8 x 7,680 tokens: 64 columns, long
    assert not config.scan_forms_dv_local(8, 7, 16, 128, 2)         # full width, short sequences
    assert not config.scan_forms_dv_local(1, 512, 32, 128, 2)       # a lone 32,768-token sequence: 32 columns
    assert GDNKernelConfig(scan_local_dv_min_chunks=0).scan_forms_dv_local(8, 1, 16, 128, 2)
    with pytest.raises(ValueError, match="scan_local_dv_min_chunks"):
        GDNKernelConfig(scan_local_dv_min_chunks=-1)


def test_scan_stages_fit_shared_memory():
    """fp32 scans at K=V=128 fit the H200's 227 KiB of shared memory only at 1 stage (docs/gdn_kernels.md), whatever
    the 16-bit default; an explicit depth overrides both."""
    for config in (GDNKernelConfig(), GDNKernelConfig(scan_warps=4), GDNKernelConfig(scan_num_stages=0)):
        assert config.scan_stages_for(4) == 1
        assert config.scan_stages_for(2) >= 1
    assert GDNKernelConfig(scan_num_stages=3).scan_stages_for(2) == 3


@pytest.mark.parametrize("field, value", [("wy_kkt_block_k", 8), ("wy_kkt_block_k", 0),
                                         ("scan_block_v", 8), ("scan_block_v", 48), ("scan_block_v", 0),
                                         ("scan_warps", 3), ("scan_warps", 8), ("scan_min_programs", -1),
                                         ("scan_num_stages", 4), ("scan_num_stages", -1),
                                         ("scan_q_do_precision", "tf32"), ("scan_tma_max_block_v", -1)])
def test_bad_key_blocks_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        GDNKernelConfig(**{field: value})


def test_q_do_precision_by_call():
    """"auto" pays for the hi + lo q^T do only in calls that return d(initial state)."""
    codes = {p: [GDNKernelConfig(scan_q_do_precision=p).scan_q_do_code(wanted) for wanted in (False, True)]
             for p in ("auto", "bf16", "bf16x2")}
    assert codes == {"auto": [0, 1], "bf16": [0, 0], "bf16x2": [1, 1]}


def test_lanes_are_contiguous_blocks_of_trees():
    """tree.py's lanes: independent trees (components of the state hand-offs) in contiguous blocks, one
    launch per lane and round; a round that interleaves trees falls back to one lane, and so does a plan of one
    round (trajectory-wise: nothing waits); empty rounds pass."""
    import numpy as np

    from harts_compiler.codegen.kernels.chunk_gdn.lanes import assign_lanes, lane_runs
    rows = np.ones(6, dtype=np.int64)
    # round 0: roots of trees A, B, C; round 1: A's branch, B's two, C's
    parent = np.array([-1, -1, -1, 0, 1, 1, 2])
    lane, n = assign_lanes([3, 4], np.ones(7), parent, max_lanes=8)
    assert n == 3 and lane.tolist() == [0, 1, 2, 0, 1, 1, 2]
    lane, n = assign_lanes([3, 4], np.ones(7), parent, max_lanes=2)
    assert n == 2 and all(len(lane_runs(lane[a:b])) <= 2 for a, b in [(0, 3), (3, 7)])
    assert lane[3] == lane[0] and lane[4] == lane[5] == lane[1] and lane[6] == lane[2]
    # round 1 interleaves A and B: A, B, A
    lane, n = assign_lanes([2, 3], np.ones(5), np.array([-1, -1, 0, 1, 0]), max_lanes=8)
    assert n == 1 and not lane.any()
    lane, n = assign_lanes([2, 0, 2], rows[:4], np.array([-1, -1, 0, 1]), max_lanes=8)  # an empty round
    assert n == 2 and lane.tolist() == [0, 1, 0, 1] and lane_runs(lane[2:2]) == []
    lane, n = assign_lanes([3, 0], np.array([100, 1, 1]), np.array([-1, -1, -1]), max_lanes=2)  # a big tree first
    assert n == 2 and lane.tolist() == [0, 1, 1]
    lane, n = assign_lanes([3], np.array([100, 1, 1]), np.array([-1, -1, -1]), max_lanes=2)  # one round: no waits
    assert n == 1 and not lane.any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.data())
def test_export_segments_cut_each_sequence_after_its_exports(lengths, data):
    """index.GDNIndex's export segments: per sequence, ascending chunk counts ending at its chunk count (a
    sentinel of slot -1), one entry per distinct export before it, each with the slot that export got."""
    import numpy as np
    import torch

    from harts_compiler.codegen.kernels.chunk_gdn import prepare_gdn_index
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    candidates = [(s, off) for s, n in enumerate(lengths) for off in range(64, n + 1, 64)]
    exports = data.draw(st.lists(st.sampled_from(candidates), max_size=8)) if candidates else []
    index = prepare_gdn_index(torch.tensor(bounds), [s for s, _ in exports], [o for _, o in exports])
    start, end, slot = (t.tolist() for t in (index.seq_export_start, index.export_end_chunk, index.export_end_slot))
    for s, n in enumerate(lengths):
        entries = list(zip(end[start[s]:start[s + 1]], slot[start[s]:start[s + 1]]))
        assert entries[-1] == (-(-n // 64), -1)
        wanted = sorted({off // 64: index.export_slot_host[i] for i, (t, off) in enumerate(exports) if t == s}.items())
        assert entries[:-1] == wanted


def test_affine_row_shifts_cover_the_rows_after_each_first_chunk():
    """PackedRows.seq_shift: a replay inside a sequence's first chunk is fine; a jump later (or a replayed row
    there) breaks the alignment rule the scans rely on: an error naming the sequence."""
    import numpy as np

    from harts_compiler.codegen.kernels.chunk_gdn.index import affine_chunk_shifts, affine_row_shifts

    def row_shifts(cu, src, own, chunk_size):  # as plan_tree_gdn derives them, from the per-chunk shifts
        return affine_row_shifts(cu, affine_chunk_shifts(cu, src, own, chunk_size), chunk_size)
    cu = np.array([0, 100, 100, 130])  # a 100-row sequence, an empty one, a 30-row one
    src = np.r_[np.arange(500, 506), np.arange(10, 104), np.arange(300, 330)]  # 6 replayed rows first
    own = np.r_[-1 - np.arange(6), np.arange(10, 104), np.arange(300, 330)]
    assert row_shifts(cu, src, own, 64).tolist() == [103 - 99, 0, 300 - 100]
    jump = src.copy()
    jump[80:] += 1000                      # rows 80.. of the first sequence come from elsewhere
    with pytest.raises(ValueError, match="sequence 0 holds replayed or non-consecutive rows after its first chunk"):
        row_shifts(cu, jump, np.where(own >= 0, jump, own), 64)
    late_replay = own.copy()
    late_replay[70] = -7                   # a replayed row after the first chunk
    with pytest.raises(ValueError, match="sequence 0"):
        row_shifts(cu, src, late_replay, 64)


def test_affine_chunk_shifts_keep_the_maps_only_where_a_chunk_needs_them():
    """PackedRows.chunk_shift: per chunk of the same layout, the shift where every row is an own token at row +
    shift, NO_SHIFT for a chunk with a replayed row or a jump; chunks as prepare_gdn_index lays them out."""
    import numpy as np

    from harts_compiler.codegen.kernels.chunk_gdn.index import NO_SHIFT, affine_chunk_shifts, prepare_gdn_index
    cu = np.array([0, 100, 100, 130])
    src = np.r_[np.arange(500, 506), np.arange(10, 104), np.arange(300, 330)]  # 6 replayed rows first
    own = np.r_[-1 - np.arange(6), np.arange(10, 104), np.arange(300, 330)]
    shifts = affine_chunk_shifts(cu, src, own, 64)
    assert shifts.size == prepare_gdn_index(cu.tolist()).num_chunks == 3
    assert shifts.tolist() == [NO_SHIFT, 103 - 99, 300 - 100]
    jump = src.copy()
    jump[80:90] += 1000                    # a gap inside the second chunk
    assert affine_chunk_shifts(cu, jump, np.where(own >= 0, jump, own), 64).tolist() == [NO_SHIFT, NO_SHIFT, 200]
    assert affine_chunk_shifts(np.array([0, 0]), src[:0], own[:0], 64).size == 0


@pytest.mark.parametrize("offset", [0, 96, 192])
def test_prepare_gdn_index_rejects_exports_outside_their_sequence(offset):
    """The scans write each segment's chunks in place: an export past its sequence (or off the chunk grid)
    must be an error naming it, not writes into the next sequence."""
    from harts_compiler.codegen.kernels.chunk_gdn import prepare_gdn_index
    with pytest.raises(ValueError, match=r"GDN plan: `export_offset\[1\]`"):
        prepare_gdn_index([0, 128, 200], [0, 0], [64, offset])
