"""Toy-size CPU runs of the GDN benchmarks (bench/gdn_batch.py, gdn_scans.py, gdn_rounding.py, gdn_ncu.py), so they
cannot rot: each must finish and report what its GPU runs report."""
import math
import os
import subprocess
import sys

import numpy as np
import torch
from bench_scripts import BENCH, bench_on_path, run_bench


def test_gdn_batch_tiny_cpu(tmp_path):
    """bench/gdn_batch.py: tree vs trajectory-wise GDN rounds on generated batches."""
    result = run_bench("gdn_batch.py", tmp_path)
    table = result.stdout.splitlines()[-3:]
    assert "tree ms" in table[0] and "of ideal" in table[0]
    for line, preset in zip(table[1:], ["swe", "tau2"]):
        cells = line.split()
        assert cells[0] == preset
        assert all(math.isfinite(float(c)) and float(c) > 0 for c in cells[1:]), line


def test_gdn_batch_times_trees_in_pieces(tmp_path):
    """bench/gdn_batch.py at a budget below the trees: each piece runs with its carried replay rows and states."""
    import ast
    result = run_bench("gdn_batch.py", tmp_path, "--presets", "tau2", "--microbatch-tokens", "64")
    row = ast.literal_eval(next(line for line in result.stdout.splitlines() if line.startswith("[tau2]"))[7:])
    assert row["tasks"] < len(row["sequences"])  # more forward units than trees: a tree ran in pieces
    assert math.isfinite(row["scan_ratio"]) and row["scan_ratio"] > 0
    assert math.isfinite(row["tree_ms"]) and row["tree_ms"] > 0


def test_scan_steps_count_each_lanes_longest_sequences():
    with bench_on_path():
        from gdn_batch import scan_steps
    import harts_compiler as hc
    from harts_compiler.codegen.index import trajectory_index
    from harts_compiler.predict import plan_indices
    rng = np.random.default_rng(0)
    lists = [rng.integers(0, 100, n).tolist() for n in (130, 10, 65)]
    assert scan_steps([trajectory_index(lists, ["a", "b", "c"], chunk_size=64, conv_width=4)]) == 3  # one launch
    # a tree: 150 root tokens, branches at 20, 64 and 150; its rounds wait for each other, so the path is at least
    # its longest trajectory's chunks and at most every round's longest sequence in turn
    root = lists[0] + lists[1] + lists[2][:10]
    tree = [root + [7] * 70, root[:20] + [8] * 100, root[:64] + [9] * 30, root]
    index, = plan_indices(hc.compile(hc.TreeBatch.from_trajectories(tree), hc.CompileOptions(chunk_size=64)))
    longest = max(-(-len(t) // 64) for t in tree)
    per_round = sum(int((-(-np.diff(r.cu_seqlens) // 64)).max()) for r in index.rounds)
    assert len(index.rounds) >= 2 and longest <= scan_steps([index]) <= per_round


def test_gdn_scans_interpreted(tmp_path):
    """bench/gdn_scans.py: the scans alone under a launch, on the Triton interpreter at a toy size (one head)."""
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(BENCH / "gdn_scans.py"), "--device", "cpu", "--shrink", "512",
                             "--cases", "root1", "roots6", "--launches", "16:4", "--stages", "3",
                             "--value-heads", "1"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    best = result.stdout.splitlines()[-2:]
    assert best[0].startswith("root1") and best[1].startswith("roots6"), best
    assert all("nan" not in line for line in best), best


def test_gdn_batch_chunk_ratio_is_below_the_token_ratio(tmp_path):
    """bench/gdn_batch.py --chunks-only: per-sequence partial chunks and replays cost tree mode chunks."""
    result = run_bench("gdn_batch.py", tmp_path, "--chunks-only")
    for line in result.stdout.splitlines()[-2:]:
        cells = line.split()
        ideal, chunk_ratio = float(cells[4]), float(cells[5])
        assert 0 < chunk_ratio <= ideal + 1e-9, line


def test_gdn_batch_plans_the_gdn_tree_cases_with_the_compiler(tmp_path):
    """bench/gdn_batch.py --trees: bench/gdn.py's agentic batch as the compiler plans it, one microbatch of two
    rounds in which each tree's first branch continues its root's sequence (docs/design.md section 6), so round 0
    holds the 6 roots and round 1 the other 36 branches, and fewer chunks than gdn.py's hand-made plan (1,254)."""
    result = run_bench("gdn_batch.py", tmp_path, "--presets", "--trees", "agentic", "--chunks-only")
    row = next(line for line in result.stdout.splitlines() if line.startswith("[agentic 6 trees]"))
    assert "'rounds': 2" in row and "'sequences': [[6, 36]]" in row, row
    assert "'compact': 77518" in row and "'trajectory_tokens': 188513" in row, row
    assert f"'chunk_ratio': {2963 / 1248}" in row, row


def test_gdn_rounding_emulation_is_the_reference_without_roundings():
    """bench/gdn_rounding.py's float64 chunk algorithm with no rounding point on equals the plain-torch reference
    (so what it attributes to a rounding point is that rounding), and the kernels' current form is the more
    precise one."""
    with bench_on_path():
        import gdn_rounding
        from gdn_cases import make_inputs
    from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule_reference
    (q, k, v, g, beta, h0), cu = make_inputs([200], hk=1, hv=1, kd=32, vd=16, device="cpu", seed=1)
    q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, h0))
    off = dict.fromkeys(gdn_rounding.POINTS, False)
    form = dict(u_from_t_beta=True, raw_out=True)
    ours = gdn_rounding.forward(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0[0, 0], off, **form)
    ref, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=32 ** -0.5, initial_state=h0, cu_seqlens=cu,
                                              export_seq=None, export_offset=None, chunk_size=64, use_qk_l2norm=True)
    assert torch.allclose(ours, ref[:, 0], rtol=1e-10, atol=1e-12), float((ours - ref[:, 0]).abs().max())
    every = dict.fromkeys(gdn_rounding.POINTS, True)
    inputs = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0[0, 0])

    def error(**form):
        o = gdn_rounding.forward(*inputs, every, **form)
        return float((o - ref[:, 0]).norm() / ref[:, 0].norm())
    assert error(**form) < 0.9 * error(u_from_t_beta=False, raw_out=False)


def test_gdn_ncu_summary_reads_a_raw_csv(tmp_path, capsys):
    """bench/gdn_ncu.py --summarize: ncu's notes before the header are skipped, the units row too, and each kernel
    gets its time, throughputs and largest stall reasons."""
    with bench_on_path():
        import gdn_ncu
    names = ["ID", "Kernel Name"] + [metric for _, metric, _ in gdn_ncu.COLUMNS] + [
        f"{gdn_ncu.STALL}{reason}_per_issue_active.ratio" for reason in ("long_scoreboard", "barrier", "wait", "gmma")]
    units = ["", ""] + ["ns", "%", "%", "%", "%", "register/thread"] + ["inst"] * 4
    row = ["0", "_chunk_bwd_qk_kernel", "3,458,368", "56.43", "54.46", "21.38", "12.35", "255", "3.22", "1.14", "1.02",
           "0.2"]
    path = tmp_path / "ncu.csv"
    path.write_text('==PROF== Connected to process 1\n' + "\n".join(
        ",".join(f'"{cell}"' for cell in line) for line in (names, units, row)) + "\n")
    gdn_ncu.summarize(str(path))
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[0] == "_chunk_bwd_qk_kernel"
    assert [float(x) for x in line[1:7]] == [3458.4, 56.4, 54.5, 21.4, 12.3, 255.0]
    assert " ".join(line[7:]) == "long_scoreboard 3.2, barrier 1.1, wait 1.0"
