"""Toy-size CPU runs of bench/e2e.py and bench/calibrate.py, so the GPU benchmarks cannot rot:
they must finish, write their JSON to $OUT, and report what the GPU runs report."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench_scripts import BENCH, bench_on_path, run_bench

from harts_compiler import predict
from harts_compiler.passes import cost_model as cm


@pytest.mark.parametrize("model", ["qwen3-next", "kimi-linear"])
def test_device_drawn_model_matches_from_config_distributions(model):
    """The GPU benches draw weights on the device; check that path (here on CPU) initialises
    every parameter like TreeModel.from_config does, and trains."""
    with bench_on_path():
        import common
    config = common.model_config(tiny=True, model=model)
    cpu = torch.device("cpu")
    drawn = common.build_model(config, cpu, torch.float32, seed=1, draw_on_device=True)
    reference = common.build_model(config, cpu, torch.float32, seed=1)
    named = dict(reference.named_parameters())
    for name, param in drawn.named_parameters():
        ref = named.pop(name)
        assert param.shape == ref.shape and torch.isfinite(param).all(), name
        if ref.numel() > 16 and ref.std() > 0:  # same distribution: std within 30%
            assert abs(param.std().item() / ref.std().item() - 1) < 0.3, name
        elif ref.numel() > 1 and "A_log" not in name:
            assert torch.equal(param, ref), name  # constant inits (norms, dt_bias)
    assert not named
    batch, _ = common.sized_batch("grpo", 50, length_scale=0.01, vocab_size=config.vocab_size, rollouts=2)
    _, indices, *_ = common.plan_microbatches(batch, 4096, cpu, chunk_size=16, conv_width=4)
    common.Step(drawn, indices, int(batch.lengths.sum()))()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drawn.parameters())


@pytest.mark.parametrize("model,family", [("qwen3-next", "next"), ("kimi-linear", "kimi")])
def test_e2e_tiny_cpu(tmp_path, model, family):
    result = run_bench("e2e.py", tmp_path, "--model", model)
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert payload["failures"] == [] and payload["model"]["family"] == family
    rows = {row["preset"]: row for row in payload["rows"]}
    assert set(rows) == {"swe", "tau2", "grpo"}
    for preset, row in rows.items():
        assert row["compact_tokens"] < row["trajectory_tokens"], preset
        assert row["planned_tokens"] >= row["compact_tokens"]  # split trees recompute root paths
        assert row["ideal"] == round(row["trajectory_tokens"] / row["compact_tokens"], 4)
        assert row["tree_ms"] > 0 and row["traj_ms"] > 0
        assert math.isclose(row["speedup"], row["traj_ms"] / row["tree_ms"])
        # float64 reference: both bf16 modes carry a real, finite error; tree within the factor
        assert 0 < row["err_traj"] < 0.1 and 0 <= row["err_tree"] < 0.1
        assert row["numerics_ok"] is True
        assert row["grad_rel_diff"] < 0.05
        parts = row["breakdown_ms"]
        for component in ("linear attention", "attention", "log-probs", "MoE/MLP"):
            assert parts.get(component, 0) > 0, (preset, component, parts)
        assert parts["total"] > 0 and row["tree_predicted_ms"] > 0
    assert "swe ours (trajectory mode)" in result.stdout  # no fla on the CPU: our trajectory mode is the baseline
    assert "speedup" in result.stdout and "of ideal" in result.stdout


def test_calibrate_tiny_cpu(tmp_path):
    result = run_bench("calibrate.py", tmp_path, "--write", str(tmp_path / "written.json"))
    files = sorted(p.name for p in tmp_path.glob("cost_model_*.json"))
    assert len(files) == 1, files
    model = cm.load_cost_model(tmp_path / files[0])
    assert model.device and model.date and model.source.endswith(files[0])  # loaded: source = file
    assert json.loads((tmp_path / files[0]).read_text())["source"] == "bench/calibrate.py"
    assert model.fit["held_out"]["count"] > 0 and model.fit["train"]["count"] > 0
    assert model.fit["median_rel_err"] == model.fit["held_out"]["median_rel_err"]
    assert min(model.coefficients.values()) >= 0
    assert len(model.fit["measurements"]) == 3 * 8  # three layer variants x eight shapes
    assert cm.load_cost_model(tmp_path / "written.json").coefficients == model.coefficients
    assert "held_out" in result.stdout and "median relative error" in result.stdout


def test_attention_tiny_cpu(tmp_path, monkeypatch):
    # the plain-torch path (the kernels have their own interpreter tests): the script must run and report
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = run_bench("attention.py", tmp_path)
    payload = json.loads((tmp_path / "attention.json").read_text())
    assert set(payload["table"]) == {"gqa", "mla"}
    for shape, rows in payload["table"].items():
        assert {row["case"] for row in rows} == {"P64 B3 L48", "single 256", "P64 ctx + B3 L48"}, shape
        for row in rows:
            assert row["ours_fwd"] > 0 and row["ours_bwd_tflops"] > 0 and row["flash_fwd_of_ideal"] > 0, row
        suffix = next(row for row in rows if "ctx" in row["case"])
        assert suffix["queries"] < suffix["compact"] and suffix["ideal"] == 1.0  # no query shares work
        assert rows[0]["ideal"] > 1
        errors = payload["errors"][shape]
        assert len(errors) == 2 and all(max(e["ours"]) < 1e-5 for e in errors), errors
        # SDPA's trajectories mapped back onto the tree's rows (fp32 here: equal up to rounding)
        assert all(max(e["flash"]) < 1e-5 for e in errors), errors
    assert "fwd of ideal (cuDNN)" in result.stdout


def test_external_kernel_wrappers_match_the_reference():
    """bench/anchors' wrappers put a chunk function with fla's signature ([1, T, H, D], FlashQLA has the same)
    behind the runtime's kernel signature and the single-call one: grouped value heads passed as they are (fla
    0.6.0 and FlashQLA take HV a multiple of H), zero initial states, the packed rows in place. With our
    reference behind fla's signature, both must give the reference's output on grouped heads (HK = 2, HV = 4)
    and three sequences."""
    with bench_on_path():
        import anchors
    from harts_compiler.codegen.kernels.chunk_gdn import chunk_gated_delta_rule_reference as reference

    def fla_like(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens):
        assert q.dim() == 4 and q.shape[0] == 1 and v.shape[2] == 2 * q.shape[2]  # the groups, not expanded
        if initial_state is None:
            initial_state = q.new_zeros(len(cu_seqlens) - 1, v.shape[2], q.shape[3], v.shape[3])
        o, _ = reference(q[0], k[0], v[0], g[0], beta[0], scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm_in_kernel)
        return o[None], (initial_state if output_final_state else None)

    gen = torch.Generator().manual_seed(3)
    rows, hk, hv, d = 70, 2, 4, 16
    q, k = (torch.randn(rows, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(rows, hv, d, generator=gen, dtype=torch.float64)
    g = -torch.rand(rows, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(rows, hv, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 20, 21, 70])
    h0 = torch.zeros(3, hv, d, d, dtype=torch.float64)
    expected, _ = reference(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
    o, exported = anchors.trajectory_kernel(fla_like)(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu,
                                                     use_qk_l2norm=True)
    assert torch.allclose(o, expected, rtol=0, atol=1e-12) and exported.shape == (0, hv, d, d)
    o, _ = anchors.single_call(fla_like)(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu,
                                        use_qk_l2norm=True)
    assert torch.allclose(o, expected, rtol=0, atol=1e-12)
    assert anchors.trajectory_kernel(None) is None and anchors.single_call(None) is None


def test_bound_pair_ratio_and_ceiling():
    """bench/bound.py: the attention pair ratio equals the one counted on the batch itself (each token attends
    to its position + 1 keys), and the ceiling is the harmonic mix of the token and pair ratios by the
    trajectory-wise step's pair share."""
    with bench_on_path():
        import bound
        import common
        import e2e
    args = e2e.parse_args(["--tiny", "--device", "cpu", "--presets", "tau2"])
    config = common.model_config(True, model="qwen3-next")
    row = bound.bound_row("tau2", config, cm.load_cost_model(), args)
    batch, *_ = e2e.plan_preset("tau2", config, args)
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    forest = e2e.prefix_forest(batch)
    assert row["pair_ratio"] == pytest.approx((lengths * (lengths + 1) // 2).sum()
                                              / (forest.token_position + 1).sum(), abs=1e-4)
    share = row["traj_pair_share"]
    assert 0 < share < 1
    assert row["ceiling"] == pytest.approx(1 / ((1 - share) / row["ideal"] + share / row["pair_ratio"]))
    assert min(row["ideal"], row["pair_ratio"]) <= row["ceiling"] <= max(row["ideal"], row["pair_ratio"])
    assert row["predicted"] == pytest.approx(row["traj_ms"] / row["tree_ms"]) and row["tree_ms"] > 0
    # pair speed for 90%: tree attention that much faster per pair puts the ceiling at 90% of the token ratio
    s90 = row["pair_speed_90"]
    assert 1 / ((1 - share) / row["ideal"] + share / (row["pair_ratio"] * s90)) == pytest.approx(0.9 * row["ideal"])
    assert (s90 <= 1) == (row["ceiling"] >= 0.9 * row["ideal"] - 1e-12)
    # --pair-cost-scale: the attention pairs' cost halved lowers their share and raises the ceiling
    half = bound.bound_row("tau2", config, bound.with_pair_cost_scaled(cm.load_cost_model(), 0.5), args)
    assert half["traj_ms"] == pytest.approx(row["traj_ms"] - 0.5 * share * row["traj_ms"])
    assert half["traj_pair_share"] < share and half["ceiling"] > row["ceiling"]
    assert e2e.parse_args(["--tiny", "--pair-cost-scale", "0.5"], None, bound.bound_arguments).pair_cost_scale == 0.5
    bad = subprocess.run([sys.executable, str(BENCH / "bound.py"), "--pair-cost-scale", "-1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--pair-cost-scale: needs a positive number, got -1" in bad.stderr
    # --gpu: another GPU's committed fit
    h100 = subprocess.run([sys.executable, str(BENCH / "bound.py"), "--tiny", "--presets", "tau2", "--gpu", "H100"],
                          capture_output=True, text=True, timeout=120)
    assert h100.returncode == 0 and "cost_model_h100.json (NVIDIA H100" in h100.stdout, h100.stdout + h100.stderr


def test_memory_sites_groups_live_blocks_by_their_innermost_repository_frame():
    """bench/memory_sites.py on a snapshot in the CUDA allocator's format (frames innermost first)."""
    with bench_on_path():
        import memory_sites
    root = "/repo"

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}
    ours = [frame("/site-packages/torch/nn/functional.py", 10, "linear"), frame("/repo/runtime/moe.py", 42, "forward"),
            frame("/repo/runtime/model.py", 7, "forward")]
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 1024, "requested_size": 1000, "frames": ours},
                    {"state": "inactive", "size": 4096, "frames": ours},
                    {"state": "active_allocated", "size": 512, "requested_size": 500, "frames": ours}]},
        {"blocks": [{"state": "active_allocated", "size": 2048, "requested_size": 2000, "frames": []},
                    {"state": "active_allocated", "size": 64, "requested_size": 60,
                     "frames": [frame("/site-packages/torch/x.py", 1, "f")]}]}]}
    sites = memory_sites.live_bytes_by_site(snapshot, root=root)
    assert sites == {"runtime/moe.py:42 forward": 1500, "<no stack>": 2000, "<elsewhere>": 60}


def test_step_anatomy_finds_the_peak_and_whats_live_there():
    """bench/step_anatomy.py replays the allocator trace: the highest point and the blocks alive at it."""
    with bench_on_path():
        import step_anatomy

    def event(action, addr, size, path=None):
        frames = [{"filename": f"/repo/{path}", "line": 3, "name": "f"}] if path else []
        return {"action": action, "addr": addr, "size": size, "frames": frames}
    trace = [event("alloc", 1, 100, "a.py"), event("alloc", 2, 50, "b.py"), event("free_requested", 1, 100),
             event("free_completed", 1, 100), event("alloc", 3, 30), event("alloc", 4, 90, "a.py"),
             event("free_completed", 4, 90), event("free_completed", 9, 500)]  # 9: allocated before the trace
    peak, sites = step_anatomy.peak_sites({"device_traces": [trace]}, 0, top=5, root="/repo")
    assert peak == 170  # blocks 2, 3 and 4
    assert dict(sites) == {"a.py:3 f": 90, "b.py:3 f": 50, "<no stack>": 30}


def test_gpu_idle_charges_starved_gaps_to_the_late_launch_site():
    """bench/gpu_idle.py: a gap whose next kernel was launched after the GPU went idle is charged to the host
    op around that launch; a gap whose kernel was already queued is not."""
    with bench_on_path():
        from gpu_idle import analyse
    kernel = lambda ts, c: {"cat": "kernel", "ts": ts, "dur": 10, "args": {"correlation": c}}  # noqa: E731
    launch = lambda ts, c: {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 7,  # noqa: E731
                            "args": {"correlation": c}}
    events = [kernel(0, 1), kernel(100, 2), kernel(120, 3), launch(1, 1), launch(50, 2), launch(90, 3),
              {"cat": "user_annotation", "name": "harts:MoE/MLP", "ts": 0, "dur": 200, "tid": 7},
              {"cat": "cpu_op", "name": "aten::item", "ts": 40, "dur": 30, "tid": 7},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 85, "dur": 10, "tid": 7}]
    report = analyse(events, wall_ms=1.0, top=5)
    assert report.gaps == 2 and report.busy_ms == pytest.approx(0.03)
    assert report.starved_ms == pytest.approx(0.09) and report.queued_ms == pytest.approx(0.01)
    assert report.sites == [("aten::item < MoE/MLP", pytest.approx(0.09), 1)]


def test_step_anatomy_runs_at_toy_size(tmp_path):
    result = run_bench("step_anatomy.py", tmp_path, "--presets", "tau2")
    assert "linear attention" in result.stdout and "speedup" in result.stdout and "exact-tree ceiling" in result.stdout


def test_pair_speed_needed_solves_the_ceiling_for_the_target_and_knows_when_it_cannot():
    # full-length swe's shape: token ratio 6.29x, pair ratio 3.96x, attention 31% of the trajectory-wise step
    s = predict.pair_speed_needed(0.9, 6.29, 3.96, 0.31)
    assert s == pytest.approx(1.169, abs=1e-3)
    assert predict.ceiling(6.29, 3.96 * s, 0.31) == pytest.approx(0.9 * 6.29)
    assert predict.pair_speed_needed(0.9, 6.29, 3.96, 0.0) == 0  # no attention: nothing to speed up
    # a small attention share reaches 90% without faster attention; a higher target needs more
    assert predict.pair_speed_needed(0.9, 6.29, 3.96, 0.05) < 1 < predict.pair_speed_needed(0.99, 6.29, 3.96, 0.31)
    # beyond 1 / (1 - share) of the token ratio no attention speed is enough
    assert predict.pair_speed_needed(1.5, 6.29, 3.96, 0.31) == float("inf")  # 1 / 1.5 < 1 - 0.31


def test_exact_tree_ceiling_weights_each_part_by_its_own_ratio():
    with bench_on_path():
        from step_anatomy import exact_tree_ceiling
    parts = {"attention": 30.0, "MoE/MLP": 70.0, "total": 100.0, "step wall": 120.0}
    # 100 ms becomes 70 / 7 + 30 / 3 = 20 ms: 5x, not the token ratio's 7x
    assert exact_tree_ceiling(parts, 7.0, 3.0) == pytest.approx(5.0)
    assert exact_tree_ceiling({"MoE/MLP": 10.0, "total": 10.0}, 7.0, 3.0) == pytest.approx(7.0)
    assert exact_tree_ceiling({"total": 0.0}, 7.0, 3.0) is None


def test_trajectory_sdpa_baseline_equals_our_attention():
    """bench/anchors.TrajectorySDPA as the runtime's attention kernel in trajectory mode (fp64, CPU: SDPA's math
    backend) gives the model's own log-probs and gradients; a tree microbatch is refused."""
    with bench_on_path():
        import anchors
    from harts_compiler.codegen.index import trajectory_index
    from harts_compiler.runtime import TreeModel
    model = TreeModel.from_config("tiny-qwen3-next", seed=2, dtype=torch.float64)
    rng = np.random.default_rng(0)
    trajectories = [rng.integers(0, 100, n) for n in (37, 5, 64, 1, 20)]
    index = trajectory_index(trajectories, [str(i) for i in range(5)], chunk_size=16, conv_width=4)
    plan = model.launch_plan(index)
    calls = []

    class Counted(anchors.TrajectorySDPA):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)
    results = []
    for kernel in (None, Counted()):
        if kernel is not None:
            kernel.add(plan, index)
        model.zero_grad(set_to_none=True)
        out = model(plan, attention_kernel=kernel)
        out.logprobs.sum().backward()
        results.append((out.logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert len(calls) == model.config.layer_types.count("full_attention") > 0
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(got_grads, want_grads))
    tree = trajectory_index([[1, 2, 3]], ["a"], chunk_size=16, conv_width=4)
    tree.subtree_end[:] = [3, 2, 3]  # token 1 closes its own subtree: not one run of rows
    with pytest.raises(ValueError, match="whole trajectories"):
        anchors.TrajectorySDPA().add(plan, tree)


def test_fused_ops_bench_runs_the_kernels_interpreted(tmp_path):
    """bench/fused_ops.py --tiny: the Triton norms, MoE combine and dispatch and torch's chains on the interpreter, the
    same values."""
    rows = run_bench("fused_ops.py", tmp_path).stdout.splitlines()[2:]
    assert len(rows) == 6 and all(float(line.split()[-1]) < 1e-5 and float(line.split()[-2]) < 1e-5
                                  for line in rows), rows
