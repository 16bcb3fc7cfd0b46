"""Tree-aware short conv: Triton kernel (TRITON_INTERPRET=1 on CPU) vs reference, tree == trajectories bitwise."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_compiler.codegen.kernels.causal_conv import (
    prepare_conv_index,
    tree_causal_conv,
    tree_causal_conv_parts_reference,
    tree_causal_conv_reference,
)
from harts_compiler.codegen.kernels.causal_conv.function import BLOCK_T
from harts_compiler.codegen.kernels.upload import to_device

W = 4


def tree_tables(parents, lengths):
    """Compact layout (nodes in index order, parents first) -> conv_pred [T, W-1] and every leaf's path."""
    starts, cursor = [], 0
    for n in lengths:
        starts.append(cursor)
        cursor += n
    node_path = []  # compact indices from the root to the end of each node
    for node, parent in enumerate(parents):
        prefix = node_path[parent] if parent >= 0 else []
        node_path.append(prefix + list(range(starts[node], starts[node] + lengths[node])))
    pred = torch.full((cursor, W - 1), -1, dtype=torch.long)
    for node in range(len(parents)):
        path = node_path[node]
        for depth in range(len(path) - lengths[node], len(path)):
            for j in range(W - 1):
                src = depth - (W - 1) + j
                pred[path[depth], j] = path[src] if src >= 0 else -1
    leaves = [n for n in range(len(parents)) if n not in parents]
    return pred, [node_path[n] for n in leaves]


def linear_pred(length):
    pred = torch.arange(length)[:, None] - (W - 1) + torch.arange(W - 1)[None, :]
    return pred.masked_fill(pred < 0, -1)


trees = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.tuples(*[st.integers(-1, i - 1) if i else st.just(-1) for i in range(n)]),
    st.lists(st.integers(1, 7), min_size=n, max_size=n)))


@settings(max_examples=6, deadline=None)
@given(tree=trees, seed=st.integers(0, 2 ** 16), silu=st.booleans())
def test_kernel_matches_reference_forward_and_grads(tree, seed, silu):
    parents, lengths = tree
    pred, _ = tree_tables(list(parents), lengths)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(pred.shape[0], 24, generator=gen, requires_grad=True)
    w = torch.randn(24, W, generator=gen, requires_grad=True)
    act = "silu" if silu else None
    y = tree_causal_conv(x, w, pred, act, index=to_device(prepare_conv_index(pred), x.device))
    y_ref = tree_causal_conv_reference(x, w, pred, act)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad((y * dy).sum(), [x, w])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x, w])
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tree_rows_equal_trajectory_rows_bitwise():
    # root of 5, a 2-token child shorter than the conv, three leaves under it and one under the root
    parents, lengths = [-1, 0, 1, 1, 1, 0], [5, 2, 3, 1, 6, 4]
    pred, paths = tree_tables(parents, lengths)
    x = torch.randn(pred.shape[0], 40, generator=torch.Generator().manual_seed(0))
    w = torch.randn(40, W, generator=torch.Generator().manual_seed(1))
    # the taps are summed bitwise alike in any packing; SiLU on the CPU is not: its vectorised exp and the
    # scalar exp of a buffer's tail differ in the last bit, and which rows form the tail depends on the
    # buffer's size (seen on the GPU host's CPU), so the activation is compared to 1 ulp-scale
    y_tree = tree_causal_conv(x, w, pred, activation=None)
    y_tree_silu = tree_causal_conv(x, w, pred)
    for path in paths:
        y_traj = tree_causal_conv(x[path], w, linear_pred(len(path)), activation=None)
        assert torch.equal(y_traj, y_tree[path])
        y_traj_silu = tree_causal_conv(x[path], w, linear_pred(len(path)))
        torch.testing.assert_close(y_traj_silu, y_tree_silu[path], rtol=1e-6, atol=1e-7)


def test_successor_lists_invert_conv_pred():
    pred, _ = tree_tables([-1, 0, 0, 0, 1], [3, 2, 4, 1, 2])
    index = prepare_conv_index(pred)
    for m in range(pred.shape[0]):
        got = [(int(i), int(j)) for i, j in zip(index.succ_row[index.succ_ptr[m]:index.succ_ptr[m + 1]],
                                                 index.succ_tap[index.succ_ptr[m]:index.succ_ptr[m + 1]])]
        want = [(i, j) for i in range(pred.shape[0]) for j in range(W - 1) if pred[i, j] == m]
        assert got == want
    degrees = [int((pred == m).sum()) for m in range(pred.shape[0])]
    assert index.max_degree == max(degrees) > W - 1  # the root's last token is read by every child


def test_dx_loop_bound_is_per_row_block():
    """A root token read by 20 children raises the dx kernel's loop bound of its own row block only."""
    pred, _ = tree_tables([-1] + [0] * 20, [BLOCK_T + 8] + [3] * 20)  # the root ends in the second row block
    index = prepare_conv_index(pred)
    degrees = [int((pred == m).sum()) for m in range(pred.shape[0])]
    blocks = [max(degrees[b:b + BLOCK_T]) for b in range(0, len(degrees), BLOCK_T)]
    assert index.block_degree.tolist() == blocks and len(blocks) >= 3
    assert blocks[1] == index.max_degree > 20 and max(blocks[2:]) <= W - 1


@pytest.mark.parametrize("shape, message", [((5, 3), "conv_pred"), ((6, 2), "conv_pred")])
def test_bad_conv_pred_is_named(shape, message):
    with pytest.raises(ValueError, match=message):
        tree_causal_conv(torch.randn(6, 8), torch.randn(8, W), torch.zeros(shape, dtype=torch.long))


@pytest.mark.gpu
def test_cuda_kernel_bf16_vs_fp32_reference_and_tree_bitwise():
    parents = [-1] + [0] * 8 + list(range(1, 9))
    lengths = [3000] + [700] * 8 + [300] * 8
    pred, paths = tree_tables(parents, lengths)
    pred = pred.cuda()
    x = torch.randn(pred.shape[0], 2048, device="cuda").bfloat16().requires_grad_(True)
    w = torch.randn(2048, W, device="cuda").bfloat16().requires_grad_(True)
    y = tree_causal_conv(x, w, pred, index=to_device(prepare_conv_index(pred), x.device))
    y_ref = tree_causal_conv_reference(x.float(), w.float(), pred)
    dy = torch.randn(y.shape, device="cuda")
    grads = torch.autograd.grad((y.float() * dy).sum(), [x, w])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x, w])
    for a, b in zip([y, *grads], [y_ref, *grads_ref]):
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-2
    path = torch.tensor(paths[3], device="cuda")
    y_traj = tree_causal_conv(x[path], w, linear_pred(len(paths[3])).cuda())
    assert torch.equal(y_traj, y[path])


@pytest.mark.parametrize("widths, carried, appended", [((16, 16, 32), 3, 2), ((24,), 0, 0), ((8, 40), 5, 0)])
def test_column_parts_tail_and_appended_rows(widths, carried, appended):
    """A layer's parts as strided column views of one projection, carried input rows after the own rows (read as
    taps only) and rows appended to each output: outputs and every gradient as the reference over the whole."""
    parents, lengths = [-1, 0, 0, 1], [6, 5, 3, 4]
    pred, _ = tree_tables(parents, lengths)
    own = pred.shape[0]
    gen = torch.Generator().manual_seed(sum(widths) + carried)
    if carried:  # the carried rows feed the first tokens of every node but the root, as a piece's context does
        pred = torch.cat([pred, torch.full((carried, W - 1), -1, dtype=torch.long)])
        pred[6, :] = torch.tensor([own, own + 1, own + 2])[-(W - 1):]
        pred[11, -1] = own + carried - 1
    channels = sum(widths)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels: on the GPU, else the interpreter
    wide = torch.randn(own, channels + 8, generator=gen, dtype=torch.float64)  # parts read in place
    w = torch.randn(channels, W, generator=gen, dtype=torch.float64)
    tail = torch.randn(carried, channels, generator=gen, dtype=torch.float64) if carried else None
    extra = [torch.randn(appended, c, generator=gen, dtype=torch.float64) if appended else None for c in widths]
    dys = [torch.randn(own + appended, c, generator=gen, dtype=torch.float64) for c in widths]

    def run(dtype, kernel):
        on = device if kernel else "cpu"
        leaves = [t.to(on, dtype).requires_grad_(True) for t in [wide, w] + ([tail] if carried else [])
                  + [e for e in extra if e is not None]]
        base, weight = leaves[0], leaves[1]
        parts = list(torch.split(base, list(widths) + [8], dim=1))[:-1]
        t = leaves[2] if carried else None
        ex = leaves[3:] if carried else leaves[2:]
        ex = ex if appended else [None] * len(widths)
        if kernel:
            index = to_device(prepare_conv_index(pred), base.device)
            outs = tree_causal_conv(parts, weight, pred.to(on), "silu", index=index, tail=t, appended=ex)
        else:
            outs = tree_causal_conv_parts_reference(parts, weight, pred, "silu", t, ex)
        loss = sum((o * d.to(on, dtype)).sum() for o, d in zip(outs, dys))
        return [o.detach() for o in outs] + [g.cpu() for g in torch.autograd.grad(loss, leaves)]

    got, ref = run(torch.float32, True), run(torch.float64, False)
    assert all(o.is_contiguous() for o in got[:len(widths)])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double().cpu(), b, rtol=1e-5, atol=1e-5)


def test_an_unread_output_with_appended_rows_gets_zero_gradients():
    # the kernel's autograd Function (on the GPU, or the interpreter without one): the reference leaves None
    on = "cuda" if torch.cuda.is_available() else "cpu"
    pred = torch.cat([linear_pred(10), torch.full((2, W - 1), -1, dtype=torch.long)]).to(on)
    parts = [torch.randn(10, 16, device=on, requires_grad=True) for _ in range(2)]
    weight = torch.randn(32, W, device=on, requires_grad=True)
    tail = torch.randn(2, 32, device=on, requires_grad=True)
    extra = [torch.randn(3, 16, device=on, requires_grad=True) for _ in range(2)]
    outs = tree_causal_conv(parts, weight, pred, "silu", index=to_device(prepare_conv_index(pred), parts[0].device),
                            tail=tail, appended=extra)
    outs[0].sum().backward()  # the second part's output is never read
    assert torch.equal(extra[1].grad.cpu(), torch.zeros(3, 16)) and torch.equal(extra[0].grad.cpu(), torch.ones(3, 16))
    assert torch.equal(parts[1].grad.cpu(), torch.zeros(10, 16))
