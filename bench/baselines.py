"""The trajectory-wise side of bench/e2e.py: timing a step of one mode, and the baseline, the fastest
trajectory-wise step a user can have (our kernels, fla's or FlashQLA's linear attention, SDPA's attention).

Import from a script in bench/ as `from baselines import ...`.
"""
from __future__ import annotations

import torch

from anchors import TrajectorySDPA, fla_trajectory_kernel, import_flashqla, trajectory_kernel
from common import Step, kernel_ms, median, peak_memory, time_calls


def time_mode(model, indices, trajectory_tokens, args, linear_kernel=None, attention_kernel=None):
    """Median step ms and the median host time that issued it; peak memory = weights + the step's peak above
    what was resident before it (so another mode's saved gradients do not count); a copy of the gradients."""
    step = Step(model, indices, trajectory_tokens, linear_kernel=linear_kernel, attention_kernel=attention_kernel)
    model.zero_grad(set_to_none=True)
    with peak_memory(args.device) as memory:
        host = []
        times = time_calls(step, args.device, warmup=args.warmup, repeat=args.repeat, host=host)
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    peak = None if memory["gib"] is None else weights_gib + memory["gib"]
    return ({"ms": median(times), "all_ms": times, "host_ms": median(host), "peak_gib": peak,
             "lower_ms": step.lower_ms}, step, grads)


def fla_comparison(model, traj_indices, device) -> dict:
    """Is fla's GDN kernel or SDPA's attention (torch's backend choice) faster than ours in trajectory mode?

    Times one layer's kernel, fwd+bwd, on the largest trajectory microbatch's shapes (random
    inputs): our GDN as the runtime runs it (the microbatch's launch plan) vs fla's, our tree attention
    (trajectory mask) vs SDPA per trajectory (`anchors.TrajectorySDPA`); the step estimate swaps those kernel
    times in for every layer. The launch plan is lowered and uploaded once, outside the timing."""
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        return {"fla": "not importable: baseline kernels are ours"}
    if model.config.linear_rule != "gdn":
        return {"fla": "per-kernel comparison of GDN models only (bench/kda.py and bench/attention.py time KDA and "
                       "MLA against fla and SDPA)"}
    try:
        fla_kernel = fla_trajectory_kernel("gdn")  # the same wrapper as the fla baseline step
        if fla_kernel is None:
            return {"fla": "import failed: baseline kernels are ours"}

        from harts_compiler.runtime.attention import tree_attention
        from harts_compiler.runtime.ops.linear_attention import gated_delta_rule_rounds
        c = model.config
        index = max(traj_indices, key=lambda i: i.num_tokens)
        plan = model.launch_plan(index)  # the device plan every layer of the runtime reads
        T = index.num_tokens
        bounds = index.rounds[0].cu_seqlens.tolist()  # trajectory mode: one round, a sequence per trajectory
        cu = torch.as_tensor(bounds, device=device)
        HK, HV, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        bf = dict(device=device, dtype=torch.bfloat16)
        q, k = torch.randn(T, HK, K, **bf), torch.randn(T, HK, K, **bf)
        v, beta = torch.randn(T, HV, V, **bf), torch.rand(T, HV, **bf)
        g = -torch.rand(T, HV, device=device) * 0.1
        h0 = torch.zeros(len(bounds) - 1, HV, K, V, device=device)

        def gdn_ours(q, k, v, g, beta):
            return gated_delta_rule_rounds(q, k, v, g, beta, plan, scale=K ** -0.5, state_dtype=torch.float32,
                                           use_qk_l2norm=True)

        def gdn_fla(q, k, v, g, beta):
            return fla_kernel(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0, cu_seqlens=cu,
                              use_qk_l2norm=True)[0]

        D, HQ, HKV = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        aq, ak, av = torch.randn(T, HQ, D, **bf), torch.randn(T, HKV, D, **bf), torch.randn(T, HKV, D, **bf)

        def attn_ours(q, k, v):  # the plan's block lists (built with the plan, outside the timing)
            return tree_attention(q, k, v, plan, scale=D ** -0.5)

        sdpa = TrajectorySDPA()
        sdpa.add(plan, index)

        def attn_sdpa(q, k, v):
            return sdpa(q, k, v, plan, scale=D ** -0.5)

        def fwd_bwd(fn, tensors):
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
            fn(*leaves).float().sum().backward()

        ms = {name: kernel_ms(lambda fn=fn, ts=ts: fwd_bwd(fn, ts), device) for name, fn, ts in [
            ("gdn_ours_ms", gdn_ours, (q, k, v, g, beta)), ("gdn_fla_ms", gdn_fla, (q, k, v, g, beta)),
            ("attn_ours_ms", attn_ours, (aq, ak, av)), ("attn_sdpa_ms", attn_sdpa, (aq, ak, av))]}
        L_lin, L_full = c.layer_types.count("linear_attention"), c.layer_types.count("full_attention")
        saving = (L_lin * max(0.0, ms["gdn_ours_ms"] - ms["gdn_fla_ms"])
                  + L_full * max(0.0, ms["attn_ours_ms"] - ms["attn_sdpa_ms"]))
        import fla
        return {"fla": f"importable ({getattr(fla, '__version__', '?')})", "tokens": T, **ms,
                "est_saving_per_microbatch_ms": saving,
                "faster": [n for n, a, b in [("fla GDN", "gdn_fla_ms", "gdn_ours_ms"),
                                             ("SDPA", "attn_sdpa_ms", "attn_ours_ms")] if ms[a] < ms[b]]}
    except Exception as exc:  # noqa: BLE001 - an optional comparison must not sink the benchmark
        return {"fla": f"importable, comparison failed: {exc!r}"}


def external_kernels(rule: str, args) -> list[tuple[str, str, object]]:
    """(name, result key, trajectory-wise kernel) of every importable external kernel of the rule: fla's
    chunk_gated_delta_rule / chunk_kda and, for GDN, FlashQLA's, those named by --baselines; none on the CPU or
    with --no-fla."""
    if args.device.type == "cpu" or args.no_fla:
        return []
    found = [(f"fla {rule.upper()}", "traj_fla_ms", fla_trajectory_kernel(rule))] if "fla" in args.baselines else []
    if rule == "gdn" and "flashqla" in args.baselines:
        found.append(("FlashQLA GDN", "traj_flashqla_ms", trajectory_kernel(import_flashqla())))
    return [entry for entry in found if entry[2] is not None]


def baseline_timing(model, traj_indices, row, args, ours_ms) -> dict:
    """The trajectory-wise baseline is the fastest of our kernels in trajectory mode and the same step with
    each importable external kernel of the model's linear-attention rule in every linear-attention layer
    (fla's chunk_gated_delta_rule or chunk_kda; FlashQLA's chunk_gated_delta_rule), on CUDA."""
    result = {"traj_fla_ms": None, "traj_flashqla_ms": None, "traj_sdpa_ms": None,
              "baseline": "ours (trajectory mode)", "baseline_ms": ours_ms}

    def candidate(name, key, kernel, attention=None) -> bool:
        """Time one trajectory-wise variant; True when it is the new baseline."""
        try:
            timed, _, _ = time_mode(model, traj_indices, row["trajectory_tokens"], args, linear_kernel=kernel,
                                    attention_kernel=attention)
        except Exception as exc:  # noqa: BLE001 - an optional baseline must not sink the benchmark
            print(f"  trajectory-wise with {name} failed: {exc!r}")
            return False
        print(f"  trajectory-wise, {name}: {timed['ms']:.1f} ms/step", flush=True)
        result[key] = timed["ms"]
        if timed["ms"] >= result["baseline_ms"]:
            return False
        result.update(baseline=f"{name} (trajectory mode)", baseline_ms=timed["ms"])
        return True

    best_name, best_kernel = "ours", None
    for name, key, kernel in external_kernels(model.config.linear_rule, args):
        if candidate(name, key, kernel):
            best_name, best_kernel = name, kernel
    if args.device.type != "cpu" and not args.no_fla and "sdpa" in args.baselines and not model.config.is_kimi:
        # GQA: SDPA takes these shapes
        candidate(f"{best_name} + SDPA attention", "traj_sdpa_ms", best_kernel, TrajectorySDPA())
    return result
