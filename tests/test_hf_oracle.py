"""Oracle: the runtime against transformers itself (docs/design.md section 11; the model map is docs/models.md).

Tiny random Qwen3-Next / Qwen3.5 / Qwen3.5-MoE models with eager attention; flash-linear-attention
is not installed, so transformers runs its torch fallbacks. `TreeModel.from_hf(m)` shares m's
parameters: tree-mode log-probs must equal m's own forward on each trajectory, the MoE aux loss
must equal transformers' on the right-padded batch with its 2-D attention mask, and the gradients
that a random weighted sum of them leaves on m's parameters must equal the trajectory-wise ones.
transformers computes in fp32, so the bar is ~1e-5.
"""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harts_compiler.runtime import TreeModel  # noqa: E402
from test_runtime_helpers import naive_tree_index, per_expert_tensors, random_rollout_batch  # noqa: E402
from test_runtime_tree import compiled_index, rel  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
            attn_implementation="eager")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
           output_router_logits=True)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(TINY, intermediate_size=128, **MOE)),
    # decoder_sparse_step=2 + mlp_only_layers: dense and MoE layers mixed
    "qwen3_next_mixed": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         dict(TINY, intermediate_size=128, decoder_sparse_step=2, mlp_only_layers=[3],
                              norm_topk_prob=False, **MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(TINY, intermediate_size=128)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(TINY, **MOE)),
}
LOGPROB_TOL = 1e-5
GRAD_TOL = 1e-4  # fp32 gradients through ~10 layers of different summation orders


def hf_model(family: str, seed: int = 0):
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that every path shows in the outputs
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 0.5 + 0.05))
            elif p.dim() == 1:
                p.add_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    return model


def hf_trajectory_logprobs(model, batch):
    """Per trajectory, m's own forward: [rows, max_len] like TreeOutput.logprobs."""
    rows = torch.zeros(len(batch), max(map(len, batch)))
    for r, traj in enumerate(batch):
        ids = torch.tensor([traj])
        logits = model(ids).logits.float()
        rows[r, 1:len(traj)] = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return rows


def hf_padded_aux_loss(model, batch):
    """transformers' aux loss on the right-padded batch with a 2-D attention mask (trajectory-wise semantics)."""
    ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, traj in enumerate(batch):
        ids[r, :len(traj)] = torch.tensor(traj)
        mask[r, :len(traj)] = 1
    return model(ids, attention_mask=mask, output_router_logits=True).aux_loss


def oracle_batch(seed=11):
    return random_rollout_batch(random.Random(seed), vocab=128, n_traj=5, max_len=40)


@pytest.mark.parametrize("family,builder", [(f, "naive") for f in FAMILIES] + [("qwen3_next", "compiled")])
def test_logprobs_and_gradients_match_transformers(family, builder):
    model = hf_model(family)
    batch = oracle_batch()
    tree = TreeModel.from_hf(model)
    assert tree.lm_head.weight is model.lm_head.weight  # shared, not copied
    index = naive_tree_index(batch, chunk_size=4) if builder == "naive" else compiled_index(batch, 4)
    moe = "num_experts" in FAMILIES[family][2]
    weights = torch.randn(len(batch), max(map(len, batch)), generator=torch.Generator().manual_seed(1))

    model.zero_grad(set_to_none=True)
    reference = hf_trajectory_logprobs(model, batch)
    loss = (reference * weights).sum()
    if moe:
        reference_aux = hf_padded_aux_loss(model, batch)
        loss = loss + 3.0 * reference_aux
    loss.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    out = tree(index)
    assert rel(out.logprobs, reference) < LOGPROB_TOL
    loss = (out.logprobs * weights).sum()
    if moe:
        assert rel(out.aux_loss, reference_aux) < LOGPROB_TOL
        loss = loss + 3.0 * out.aux_loss
    else:
        assert out.aux_loss is None
    loss.backward()
    for name, p in model.named_parameters():
        assert rel(p.grad, reference_grads[name]) < GRAD_TOL, f"{name}: rel {rel(p.grad, reference_grads[name]):.3g}"


def test_tied_embeddings_share_one_parameter():
    config_cls, model_cls, kwargs = FAMILIES["qwen3_5"]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs, tie_word_embeddings=True))
    tree = TreeModel.from_hf(model.eval())
    assert tree.lm_head.weight is tree.model.embed_tokens.weight is model.model.embed_tokens.weight
    batch = oracle_batch(3)
    out = tree(naive_tree_index(batch, chunk_size=64))
    assert rel(out.logprobs, hf_trajectory_logprobs(model, batch)) < LOGPROB_TOL


def test_from_pretrained_reads_checkpoint_names(tmp_path):
    """A checkpoint as on disk: Qwen3.5 prefix, per-expert keys, mtp.* weights to ignore."""
    from safetensors.torch import save_file

    model = hf_model("qwen3_5_moe")
    tensors = {}
    for name, p in model.state_dict().items():
        name = name.replace("model.", "model.language_model.", 1)
        tensors.update(per_expert_tensors(name, p, "gate_proj", "up_proj", "down_proj") or {name: p.contiguous()})
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = model.config.to_dict()
    config["layer_types"] = list(model.config.layer_types)
    (tmp_path / "config.json").write_text(__import__("json").dumps({"model_type": "qwen3_5_moe",
                                                                     "text_config": config}))
    loaded = TreeModel.from_pretrained(tmp_path)
    batch = oracle_batch(5)
    out = loaded(naive_tree_index(batch, chunk_size=4))
    assert rel(out.logprobs, hf_trajectory_logprobs(model, batch)) < LOGPROB_TOL


def test_qwen3_5_multimodal_wrapper_uses_its_language_model():
    """Qwen3_5ForConditionalGeneration: text weights under model.language_model, vision ignored."""
    text = {k: v for k, v in FAMILIES["qwen3_5"][2].items() if k != "attn_implementation"}
    config = transformers.Qwen3_5Config(text_config=text, attn_implementation="eager", vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    tree = TreeModel.from_hf(model)
    assert tree.model.embed_tokens.weight is model.model.language_model.embed_tokens.weight
    batch = oracle_batch(7)
    out = tree(naive_tree_index(batch, chunk_size=4))
    assert rel(out.logprobs, hf_trajectory_logprobs(model, batch)) < LOGPROB_TOL
