"""Oracle: Kimi Linear and Ling 3.0 in tree mode against transformers' KimiLinearForCausalLM and
BailingHybridForCausalLM, trajectory by trajectory.

transformers' code for both casts to float32 in its norms, forget gate, router, softmax and KDA kernels, so a
float64 model of it still rounds like fp32. The fp64 oracle is therefore transformers' own modeling_kimi_linear.py
(and modeling_bailing_hybrid.py) with every float32 cast turned into float64: the source is read and rewritten
here, nothing else changes. Tree mode must match it to 1e-10 on log-probs, on every parameter gradient and on the
expert loads (each token counted once per trajectory, what updates the routing bias). The unmodified fp32 model
is checked at fp32's 1e-5.
transformers' KimiLinearAttention applies no RoPE (NoPE MLA), which is Kimi Linear's `mla_use_nope`; Ling 3.0's
gated MLA applies interleaved RoPE at each token's position.
"""
from __future__ import annotations

import importlib.util
import inspect
import random
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
kimi_modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
ling_modeling = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")

from harts_compiler.runtime import TreeModel  # noqa: E402
from test_runtime_helpers import naive_tree_index, per_expert_tensors  # noqa: E402
from test_runtime_tree import _tokens, compiled_index, rel, tricky_batches  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, num_local_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
            moe_intermediate_size=32, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=None, bos_token_id=1, eos_token_id=2,
            attn_implementation="eager", experts_implementation="eager")
LING_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                 head_dim=16, short_conv_kernel_size=4, num_local_experts=8, num_experts_per_tok=2, n_group=4,
                 topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=32,
                 layer_group_size=2, first_k_dense_replace=1, rope_theta=10000.0, pad_token_id=None, eos_token_id=2,
                 attn_implementation="eager", experts_implementation="eager")
# variant -> (transformers modeling module, config class, model class, config kwargs)
VARIANTS = {
    "q_lora": (kimi_modeling, "KimiLinearConfig", "KimiLinearForCausalLM", dict(TINY, q_lora_rank=24)),
    "plain_q": (kimi_modeling, "KimiLinearConfig", "KimiLinearForCausalLM",
                dict(TINY, q_lora_rank=None, norm_topk_prob=False, n_group=1, topk_group=1, n_shared_experts=2)),
    "q_lora_pad": (kimi_modeling, "KimiLinearConfig", "KimiLinearForCausalLM", dict(TINY, q_lora_rank=24,
                                                                                   pad_token_id=0)),
    "ling": (ling_modeling, "BailingHybridConfig", "BailingHybridForCausalLM", dict(LING_TINY, q_lora_rank=24)),
    "ling_unsafe_gate": (ling_modeling, "BailingHybridConfig", "BailingHybridForCausalLM",
                         dict(LING_TINY, q_lora_rank=None, kda_safe_gate=False)),
}


def _fp64_modeling(original):
    """transformers' modeling module with float64 where it says float32 (counted, so an upstream change of the
    casts fails here rather than silently comparing against fp32 arithmetic)."""
    source = inspect.getsource(original)
    casts = source.count("torch.float32") + source.count(".float()")
    assert casts >= 8, f"expected transformers' float32 casts in {original.__name__}, found {casts}"
    source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    package = original.__name__.rpartition(".")[0]
    spec = importlib.util.spec_from_loader(original.__name__ + "_fp64", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    module.__file__ = original.__file__  # transformers inspects where its classes come from
    sys.modules[spec.name] = module  # transformers resolves the classes' annotations through sys.modules
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module


_FP64 = {}


def hf_kimi(variant: str, dtype=torch.float64, seed=0):
    original, config_class, model_class, kwargs = VARIANTS[variant]
    module = original
    if dtype == torch.float64:
        if original.__name__ not in _FP64:
            _FP64[original.__name__] = _fp64_modeling(original)
        module = _FP64[original.__name__]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    model = getattr(module, model_class)(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    safe_gate = getattr(config, "kda_safe_gate", False)
    with torch.no_grad():  # weights large enough that every path shows; decays that carry over many chunks
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.05))
            elif name.endswith("dt_bias") and safe_gate:  # sigmoid(A (f - 3)) small: decays near 0, not -5 / 2
                p.copy_(-3.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.add_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float64))
    return model


def hf_trajectories(model, batch, dtype):
    """The HF model on the right-padded batch of all trajectories with its 2-D attention mask (what
    trajectory-wise training runs; right padding changes no earlier token): log-probs [rows, max_len] and expert
    loads [moe layers, E] over the real tokens."""
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: picks.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, traj in enumerate(batch):
        ids[r, :len(traj)] = torch.tensor(traj)
        mask[r, :len(traj)] = 1
    logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.to(dtype), -1)
    for hook in hooks:
        hook.remove()
    rows = torch.zeros(ids.shape, dtype=dtype)
    rows[:, 1:] = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    real = mask.reshape(-1).bool()
    loads = [torch.bincount(p.reshape(ids.numel(), -1)[real].reshape(-1), minlength=model.config.num_experts)
             for p in picks]
    return rows, torch.stack(loads).to(dtype)


def _batches():
    rng = random.Random(5)
    cases = tricky_batches(4)
    chain = _tokens(rng, 23)
    cases["deep_chain"] = [chain, chain[:17] + _tokens(rng, 3), chain[:9] + _tokens(rng, 9), chain[:21]]
    return cases


BATCHES = _batches()
# transformers' backward is the slow part here: the cases where the tree's structure differs most; all tricky
# cases run tree mode against trajectory-wise mode in test_kimi_tree.py
HF_CASES = ["branch_on_chunk_boundary", "branch_in_first_chunk", "prefix_and_duplicate_trajectories", "deep_chain"]


def _check(model, batch, index, dtype, tol, grad_tol):
    tree = TreeModel.from_hf(model)
    weights = torch.randn(len(batch), max(map(len, batch)), generator=torch.Generator().manual_seed(1), dtype=dtype)
    model.zero_grad(set_to_none=True)
    reference, reference_load = hf_trajectories(model, batch, dtype)
    (reference * weights).sum().backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    out = tree(index)
    order = [out.trajectory_ids.index(str(i)) for i in range(len(batch))]
    logprobs = out.logprobs[order]
    assert out.aux_loss is None  # transformers computes no auxiliary loss for Kimi's biased routing
    assert rel(logprobs, reference) < tol, f"logprobs rel {rel(logprobs, reference):.3g}"
    assert torch.equal(out.expert_load, reference_load)
    (logprobs * weights).sum().backward()
    worst = max((rel(p.grad, reference_grads[n]), n) for n, p in model.named_parameters())
    assert worst[0] < grad_tol, f"gradient of {worst[1]} rel {worst[0]:.3g}"


@pytest.mark.parametrize("variant,name", [("q_lora", n) for n in HF_CASES]
                         + [("ling", n) for n in ("branch_on_chunk_boundary", "deep_chain")])
def test_tree_mode_equals_transformers_fp64(variant, name):
    batch = BATCHES[name]
    _check(hf_kimi(variant), batch, naive_tree_index(batch, chunk_size=4), torch.float64, 1e-10, 1e-10)


@pytest.mark.parametrize("variant", ["plain_q", "ling_unsafe_gate"])
def test_compiled_plan_other_variants_fp64(variant):
    batch = BATCHES["replay_across_short_nodes" if variant == "plain_q" else "prefix_and_duplicate_trajectories"]
    _check(hf_kimi(variant), batch, compiled_index(batch, 4), torch.float64, 1e-10, 1e-10)


def test_pad_token_row_gets_no_gradient_as_in_transformers():
    """pad_token_id is transformers' padding_idx: a trajectory holding that token leaves its row's gradient 0."""
    batch = BATCHES["deep_chain"]
    assert any(0 in t for t in batch)
    _check(hf_kimi("q_lora_pad"), batch, naive_tree_index(batch, chunk_size=4), torch.float64, 1e-10, 1e-10)


@pytest.mark.parametrize("variant", ["q_lora", "ling"])
def test_unmodified_transformers_fp32(variant):
    batch = BATCHES["branch_in_first_chunk"]
    _check(hf_kimi(variant, dtype=torch.float32), batch, naive_tree_index(batch, chunk_size=4), torch.float32,
           1e-5, 1e-4)


def test_from_hf_shares_parameters_and_routing_bias():
    model = hf_kimi("q_lora")
    tree = TreeModel.from_hf(model)
    layer = model.model.layers[1]
    assert tree.model.layers[1].self_attn.kv_b_proj.weight is layer.self_attn.kv_b_proj.weight
    assert tree.model.layers[1].mlp.gate.e_score_correction_bias is layer.mlp.gate.e_score_correction_bias
    assert tree.model.layers[0].self_attn.forget_gate.A_log is model.model.layers[0].self_attn.forget_gate.A_log


def _released_layout(model) -> dict[str, torch.Tensor]:
    """The HF model's weights under the released checkpoint's names (transformers' conversion undone)."""
    out = {}
    for name, p in model.state_dict().items():
        p = p.contiguous()
        name = name.replace(".forget_gate.", ".")
        if name.endswith("self_attn.conv1d.weight"):
            for part, piece in zip("qkv", p.chunk(3, dim=0)):
                out[name.replace("conv1d", f"{part}_conv1d")] = piece.contiguous()
            continue
        if ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.shared_experts." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        out.update(per_expert_tensors(name, p, "w1", "w3", "w2") or {name: p})
    return out


def test_from_pretrained_reads_the_released_layout(tmp_path):
    """config.json as released (linear_attn_config with 1-based layer lists, first_k_dense_replace, on-disk MoE
    names) and weights under the released names: the same model as from_hf."""
    import json

    from safetensors.torch import save_file

    model = hf_kimi("q_lora", dtype=torch.float32)
    save_file(_released_layout(model), str(tmp_path / "model.safetensors"))
    config = {k: v for k, v in TINY.items() if k not in ("layer_types", "mlp_layer_types", "attn_implementation",
                                                          "experts_implementation", "linear_num_heads",
                                                          "linear_head_dim", "linear_conv_kernel_dim")}
    config.update(model_type="kimi_linear", q_lora_rank=24, first_k_dense_replace=1, mla_use_nope=True,
                  moe_router_activation_func="sigmoid", linear_attn_config=dict(
                      kda_layers=[1, 3], full_attn_layers=[2, 4], num_heads=2, head_dim=16, short_conv_kernel_size=4))
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = TreeModel.from_pretrained(tmp_path)
    assert loaded.config == TreeModel.from_hf(model).config
    batch = BATCHES["branch_on_chunk_boundary"]
    index = naive_tree_index(batch, chunk_size=4)
    assert torch.equal(loaded(index).logprobs, TreeModel.from_hf(model)(index).logprobs)
