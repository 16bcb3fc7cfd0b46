"""The runtime on its kernel path without a GPU: the launch target forced to the Triton kernels (GDN or KDA rounds
with state exports and injected state gradients, the tree conv, tree attention, chunked log-probs), which Triton's
interpreter runs on the CPU in fp32. Tree mode, trees in pieces and trajectory-wise training through the kernels
equal the plain-torch path of the same model, so the runtime's wiring of the kernels (row maps, views, carried
tensors, gradient injection) is checked before any GPU run; tests/test_runtime_gpu.py runs the same code compiled,
in bf16."""
import copy
import dataclasses
import random

import pytest
import torch

import harts_compiler as hc
from harts_compiler.codegen.kernels.interpreter_safe import interpreting
from harts_compiler.codegen.kernels.tree_attention import config_for
from harts_compiler.runtime import PRESETS, TreeModel, trajectory_wise
from harts_compiler.runtime import model as model_module
from harts_compiler.runtime.weights import randomise_for_verification_
from test_runtime_tree import rel

pytestmark = [pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                                 reason="the interpreter's CPU run of the kernels (a GPU runs test_runtime_gpu.py)"),
              # numpy's warning on padding rows past a sequence's end (0 * inf), which the kernels mask out
              pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")]

# the smallest shapes the kernels take: GDN and attention head dims 16, chunk 64 (the GDN kernels' own)
CONFIG = dict(model_type="qwen3_next", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
              linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=32)
# Kimi Linear (KDA + MLA + grouped routing) at 2 layers, MLA's q/k head dim a sum of two tiles (16 + 16) as at 192
KIMI_CONFIG = dict(PRESETS["tiny-kimi-linear"], num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse"], qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
VALUE_TOL = 1e-5  # fp32 log-probs and entropies: the two paths sum in different orders
# gradients are judged against float64: A_log's and dt_bias's sum away most of their terms, so both fp32 paths
# are up to ~2e-5 (relative) from float64 there, the kernels' chunked algebra 2-6x further than the torch path's
# (beyond 4x in 2 of 228 random batches), and direct fp32 bars would test that cancellation, not the wiring. Each
# gradient may be GRAD_FACTOR times the torch path's distance from float64, or the design's fp32 gradient bar; a
# wiring error (a state not handed over, a gradient not injected) is off by order 1e-3 or more
GRAD_FACTOR, GRAD_FLOOR = 4.0, 5e-5


def _forced(select):
    def forced(config, dtype, device, **options):
        target = select(config, dtype, device, **options)
        if dtype != torch.float32:  # the float64 reference keeps the torch path (the kernels refuse float64)
            return target
        qk_dim, v_dim = config.attention_head_dims
        return dataclasses.replace(target, gdn_triton=True, conv_triton=True,
                                   attention_tiles=config_for(qk_dim, v_dim).tiles, logprobs_triton=True)
    return forced


@pytest.fixture
def kernel_path(monkeypatch):
    """Make every fp32 launch plan target the Triton kernels, whatever the device."""
    monkeypatch.setattr(model_module, "select_backend", _forced(model_module.select_backend))
    return monkeypatch


def _token_lists(small: bool = False):
    """A shared root past one or two chunks with branches on and across chunk boundaries and a prefix; the full
    batch adds a duplicate and a branch off a branch."""
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(128) for _ in range(n)]  # noqa: E731
    root = draw(90 if small else 150)
    lists = [root + draw(n) for n in ((20, 50) if small else (20, 90, 3))]
    lists += [root[:64] + draw(30 if small else 40), root[:70] + draw(40 if small else 75), root[:30]]
    return lists if small else lists + [list(lists[0]), lists[1][:200] + draw(30)]


def _model(seed: int, config: dict = CONFIG) -> TreeModel:
    """fp32 weights under which states carry across chunks and every path matters (the verification draw)."""
    return randomise_for_verification_(TreeModel.from_config(config, seed=seed, dtype=torch.float32), seed)


def _step(model, microbatches, weights):
    """Log-prob and entropy rows by trajectory id, the summed aux loss and the gradients of one weighted loss."""
    model.zero_grad(set_to_none=True)
    rows, aux = {}, 0.0
    for mb in microbatches:
        out = trajectory_wise(model, mb) if isinstance(mb, list) else model(mb)  # ids "0", "1", ... both ways
        loss = out.aux_loss if out.aux_loss is not None else 0.0  # Kimi-style routing has no aux loss
        for r, traj_id in enumerate(out.trajectory_ids):
            n = int(out.lengths[r])
            w = weights[int(traj_id)][:n]
            loss = loss + (out.logprobs[r, :n] * w).sum() + 0.1 * (out.entropy[r, :n] * w).sum()
            rows[traj_id] = (out.logprobs[r, :n].detach(), out.entropy[r, :n].detach())
        loss.backward()
        aux += 0.0 if out.aux_loss is None else float(out.aux_loss.detach())
    return rows, aux, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want, exact):
    """`got` (the kernel path) against `want` (fp32, another path): rows and aux loss directly, each parameter's
    gradient no further from `exact` (float64 torch path) than GRAD_FACTOR times `want`'s."""
    (rows, aux, grads), (ref_rows, ref_aux, ref_grads), exact_grads = got, want, exact[2]
    assert rows.keys() == ref_rows.keys()
    for traj_id, (lp, ent) in ref_rows.items():
        assert rel(rows[traj_id][0], lp) < VALUE_TOL and rel(rows[traj_id][1], ent) < VALUE_TOL, traj_id
    assert abs(aux - ref_aux) <= VALUE_TOL * abs(ref_aux)
    assert grads.keys() == ref_grads.keys() == exact_grads.keys()
    for name, g in exact_grads.items():
        mine, theirs = rel(grads[name].double(), g), rel(ref_grads[name].double(), g)
        assert mine <= GRAD_FACTOR * theirs + GRAD_FLOOR, (name, mine, theirs)


def _exact(model, microbatches, weights):
    """The float64 torch path's `_step` on a copy of `model`."""
    return _step(copy.deepcopy(model).double(), microbatches, [w.double() for w in weights])


@pytest.mark.parametrize("family, budget", [("qwen3-next", None), ("qwen3-next", 128), ("kimi-linear", 128)],
                         ids=["qwen3-next one microbatch", "qwen3-next pieces", "kimi-linear pieces"])
def test_tree_mode_through_the_kernels_equals_the_torch_path(kernel_path, family, budget):
    kimi = family == "kimi-linear"  # the interpreter runs KDA's kernels slowly: a smaller batch
    token_lists = _token_lists(small=kimi)
    model = _model(0, KIMI_CONFIG if kimi else CONFIG)
    weights = [torch.randn(len(t), generator=torch.Generator().manual_seed(k)) for k, t in enumerate(token_lists)]
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists),
                      hc.CompileOptions.for_model(model, microbatch_tokens=budget))
    if budget:
        assert plan.program.pieces is not None and plan.program.pieces.num_pieces >= 2
    assert max(mb.summary()["rounds"] for mb in plan.microbatches()) >= 2
    kernels = _step(model, plan.microbatches(), weights)
    exact = _exact(model, plan.microbatches(), weights)
    kernel_path.undo()
    _assert_close(kernels, _step(model, plan.microbatches(), weights), exact)


def test_trajectory_wise_through_the_kernels_equals_tree_mode_through_them(kernel_path):
    token_lists = _token_lists()
    model = _model(1)
    weights = [torch.randn(len(t), generator=torch.Generator().manual_seed(k)) for k, t in enumerate(token_lists)]
    plan = hc.compile(hc.TreeBatch.from_trajectories(token_lists), hc.CompileOptions.for_model(model))
    tree, trajectory = _step(model, plan.microbatches(), weights), _step(model, [token_lists], weights)
    _assert_close(tree, trajectory, _exact(model, [token_lists], weights))
