"""How fast the GPU's L2 takes fp32 TMA reduce-adds from shared memory: the dq adds of a single-pass attention
backward (each key block adds its [64, 192] fp32 dq tile into an fp32 workspace), against plain TMA stores.

Every CTA keeps one [64, BN] fp32 tile in shared memory and sends it `--steps` times to a workspace of W MB
(step t of CTA p goes to workspace tile (p * steps + t) * stride mod tiles), at most `pending` transfers in
flight. A 25 MB workspace stays in the 50 MB L2; 400 MB (MLA's dq for all 16 heads of a 32k-token tree) does not.
After the first call the workspace must hold, per tile, the number of adds it received (checked exactly).
The last rows mix in the loads of a dk/dv step at MLA's shape: per step 40 KB of bf16 TMA loads (the q and do
sub-tiles, from a 25 MB input) waited for before three [64, 64] fp32 adds (the step's 48 KB dq tile).

    python bench/tma_reduce.py                 # Hopper GPU (TMA); prints a table, writes $OUT/tma_reduce.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from common import describe_device, format_table, kernel_ms, write_json


def build_kernel():
    """The probe kernel (Gluon; imported here so that the module imports on machines without Gluon)."""
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    @builtin
    def async_reduce_add(tensor_desc, coord, src, _semantic=None):
        # Gluon 3.6 has no public TMA reduce; its IR builder has the op (sm_90: UTMAREDG.2D.ADD)
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def ones_tile(ws_desc, BM, BN):  # (no annotations: a nested helper does not see the module names)
        # the [BM, BN] fp32 tile of ones every transfer sends (so each workspace tile counts its adds)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        smem = gl.allocate_shared_memory(gl.float32, [BM, BN], ws_desc.layout)
        smem.store(gl.full([BM, BN], 1.0, gl.float32, layout))
        return smem

    @gluon.jit
    def tile_coord(tile, n_col_tiles, BM, BN):
        return [(tile // n_col_tiles) * BM, (tile % n_col_tiles) * BN]

    @gluon.jit
    def probe_with_loads(ws_desc, in_desc, n_tiles, n_col_tiles, n_in_rows, steps, PEND: gl.constexpr,
                         BM: gl.constexpr, BN: gl.constexpr):
        # per step: 5 [64, 64] bf16 loads into one slot of a 2-slot ring, then 3 [64, 64] fp32 adds
        smem = ones_tile(ws_desc, BM, BN)
        ring = gl.allocate_shared_memory(in_desc.dtype, [10] + in_desc.block_type.shape, in_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)
        fence_async_shared()
        first = gl.program_id(0) * steps
        for t in range(steps):
            slot = t % 2
            row_in = ((first + t) % n_in_rows) * BM
            mbarrier.expect(ready.index(slot), 5 * in_desc.block_type.nbytes)
            for j in gl.static_range(5):
                tma.async_copy_global_to_shared(in_desc, [row_in, j * BN], ready.index(slot), ring.index(slot * 5 + j))
            # the adds of a step wait for the loads issued one step earlier (the dk/dv producer runs ahead)
            mbarrier.wait(ready.index(1 - slot), ((t - 1) // 2) & 1, pred=t > 0)
            for j in gl.static_range(3):
                tile = ((first + t) * 3 + j) % n_tiles
                tma.store_wait(PEND)
                async_reduce_add(ws_desc, tile_coord(tile, n_col_tiles, BM, BN), smem)
        mbarrier.wait(ready.index((steps - 1) % 2), ((steps - 1) // 2) & 1)
        tma.store_wait(0)

    @gluon.jit
    def probe(ws_desc, n_tiles, n_col_tiles, steps, stride, PEND: gl.constexpr, REDUCE: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr):
        smem = ones_tile(ws_desc, BM, BN)
        fence_async_shared()
        first = gl.program_id(0) * steps
        for t in range(steps):
            coord = tile_coord(((first + t) * stride) % n_tiles, n_col_tiles, BM, BN)
            tma.store_wait(PEND)
            if REDUCE:
                async_reduce_add(ws_desc, coord, smem)
            else:
                tma.async_copy_shared_to_global(ws_desc, coord, smem)
        tma.store_wait(0)

    return probe, probe_with_loads, gl


class Workspace:
    """A zeroed [rows, 16 heads x 192] fp32 dq workspace of about `mb` MB, its TMA descriptor of [64, bn] tiles."""

    def __init__(self, gl, mb: int, bn: int):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        self.bm, self.bn, cols = 64, bn, 16 * 192
        rows = int(mb * 2**20 / (cols * 4)) // self.bm * self.bm
        self.ws = torch.zeros(rows, cols, device="cuda", dtype=torch.float32)
        self.desc = TensorDescriptor.from_tensor(self.ws, [self.bm, bn],
                                                 gl.NVMMASharedLayout.get_default_for([self.bm, bn], gl.float32))
        self.n_col_tiles = cols // bn
        self.n_tiles = rows // self.bm * self.n_col_tiles

    def holds(self, tiles: torch.Tensor, counted: bool) -> bool:
        """Whether every workspace tile holds the number of `tiles` entries naming it (`counted`: adds) or 1 where
        any does (stores), exactly."""
        expected = torch.bincount(tiles % self.n_tiles, minlength=self.n_tiles)
        if not counted:
            expected = (expected > 0).to(expected.dtype)
        got = self.ws.view(-1, self.bm, self.n_col_tiles, self.bn).transpose(1, 2).reshape(self.n_tiles, -1)
        return bool((got == expected[:, None].float()).all())


def measure(probe, gl, *, workspace_mb: int, reduce: bool, bn: int, pending: int, steps: int, ctas: int,
            stride: int = 1) -> dict:
    w = Workspace(gl, workspace_mb, bn)

    def call():
        probe[(ctas,)](w.desc, w.n_tiles, w.n_col_tiles, steps, stride, PEND=pending, REDUCE=reduce, BM=w.bm, BN=bn,
                       num_warps=4)

    call()
    torch.cuda.synchronize()
    exact = w.holds(torch.arange(ctas * steps, device="cuda") * stride, counted=reduce)
    ms = kernel_ms(call, torch.device("cuda"))
    return dict(op="reduce-add" if reduce else "store", workspace_mb=workspace_mb, tile=f"64x{bn}",
                pending=pending, stride=stride, ms=ms, tb_s=ctas * steps * w.bm * bn * 4 / ms / 1e9, exact=exact)


def measure_with_loads(probe_with_loads, gl, *, steps: int, ctas: int, pending: int) -> dict:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    w = Workspace(gl, 25, 64)
    inputs = torch.randn(int(25 * 2**20 / (320 * 2)) // w.bm * w.bm, 320, device="cuda", dtype=torch.bfloat16)
    in_desc = TensorDescriptor.from_tensor(inputs, [w.bm, w.bn],
                                           gl.NVMMASharedLayout.get_default_for([w.bm, w.bn], gl.bfloat16))

    def call():
        probe_with_loads[(ctas,)](w.desc, in_desc, w.n_tiles, w.n_col_tiles, inputs.shape[0] // w.bm, steps,
                                  PEND=pending, BM=w.bm, BN=w.bn, num_warps=4)

    call()
    torch.cuda.synchronize()
    exact = w.holds(torch.arange(ctas * steps * 3, device="cuda"), counted=True)
    ms = kernel_ms(call, torch.device("cuda"))
    tile_bytes = w.bm * w.bn * 4
    return dict(op="40 KB loads + 48 KB adds a step", workspace_mb=25, tile="64x64", pending=pending, stride=1, ms=ms,
                tb_s=ctas * steps * 3 * tile_bytes / ms / 1e9, loads_tb_s=ctas * steps * 5 * tile_bytes / 2 / ms / 1e9,
                exact=exact)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=256, help="transfers per CTA")
    parser.add_argument("--ctas-per-sm", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench/tma_reduce.py needs a Hopper (sm_90) or newer GPU")
    device = torch.device("cuda")
    probe, probe_with_loads, gl = build_kernel()
    ctas = args.ctas_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for reduce in (True, False):
        for workspace_mb in (25, 400):
            for bn, pending in ((64, 2), (64, 0), (128, 1)):
                rows.append(measure(probe, gl, workspace_mb=workspace_mb, reduce=reduce, bn=bn, pending=pending,
                                    steps=args.steps, ctas=ctas))
    # many CTAs adding into nearby tiles at once, as the key blocks of one query block do
    rows.append(measure(probe, gl, workspace_mb=25, reduce=True, bn=64, pending=2, steps=args.steps, ctas=ctas,
                        stride=7))
    for pending in (2, 5):
        rows.append(measure_with_loads(probe_with_loads, gl, steps=args.steps, ctas=ctas, pending=pending))
    info = describe_device(device)
    print(info)
    print(format_table(rows, [("op", "op"), ("workspace_mb", "workspace MB"), ("tile", "tile"),
                              ("pending", "in flight"), ("stride", "stride"), ("ms", "ms"), ("tb_s", "TB/s"),
                              ("loads_tb_s", "loads TB/s"), ("exact", "values exact")]))
    write_json("tma_reduce.json", dict(device=info, steps=args.steps, ctas=ctas, rows=rows), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
