"""The public single-call wrapper, with fla's signature: one packed varlen call is a one-round plan.

Forward:  intra_fwd (gc, Aqk, T; w, u, kg)  ->  scan_fwd (h, v_new, export bank)  ->  output_fwd (o)
Backward: bwd_prep (qg, dv_local) -> scan_bwd (reverse scan with injected export gradients -> dh, dvn, dh0)
          -> chunk_bwd (inter-chunk terms; WY backward; sub-chunk blocks of dAqk, dAkk -> dq, dk, dv, dg, dbeta)
Every kernel has a fixed launch configuration (no autotuning) and no atomics, so the same chunk with the same
entering state gives the same bits in any packing. There is one execution path: `tree.kimi_delta_attention`
over GDN's `TreeGDNPlan`; this wrapper builds the plan of one call (`tree_plan.plan_single_call`) on the host
and uploads it.
"""
from __future__ import annotations

from ..chunk_gdn.config import GDNKernelConfig
from ..chunk_gdn.function import run_single_call
from ..chunk_gdn.tree_plan import CHUNK_SIZE
from .config import KDAKernelConfig
from .reference import chunk_kimi_delta_attention_reference, validate_kda_inputs
from .tree import kimi_delta_attention


def chunk_kimi_delta_attention(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, export_seq=None,
                               export_offset=None, chunk_size=CHUNK_SIZE, use_qk_l2norm=False,
                               config: KDAKernelConfig | None = None, scan_config: GDNKernelConfig | None = None):
    """Chunkwise Kimi Delta Attention: (o [R, HV, V], exported [E, HV, K, V] fp32), the arguments of
    `chunk_gdn.chunk_gated_delta_rule` with g [R, HV, K] (a log decay per key channel).

    Runs the Triton kernels on CUDA (or under TRITON_INTERPRET=1) where `chunk_gdn.triton_supports` admits the
    inputs, the plain-torch reference otherwise (GDN's single-call path, `chunk_gdn.function.run_single_call`).
    `config`: the KDA chunk kernels' launches; `scan_config`: the plan's (GDN's) scan launches and lanes. Reads
    `cu_seqlens` and the exports on the host to plan the call: a model runs its rounds through
    `tree.kimi_delta_attention` with a plan built once instead.
    """
    return run_single_call(q, k, v, g, beta, validate=validate_kda_inputs,
                           reference=chunk_kimi_delta_attention_reference, tree=kimi_delta_attention,
                           plan_config=scan_config, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           export_seq=export_seq, export_offset=export_offset, chunk_size=chunk_size,
                           use_qk_l2norm=use_qk_l2norm, config=config)
