"""Lowering: a microbatch's index tables -> the one launch plan the runtime reads (docs/INTERFACES.md section 3).

`lower(index, target)` runs on the host, once per microbatch: it checks the tables against what the model
needs (`LaunchTarget`: chunk size, conv width, vocabulary, which ops run Triton kernels), builds every launch
table the kernels take (the GDN rounds, lanes, export and injection slots and affine row shifts; the conv
successor lists; the attention block lists at every tile the kernels use, or the query windows of the torch
path; the log-prob target chunks; the embedding gradient's token groups) and verifies them there.
`LaunchPlan.to(device)` uploads the whole plan in
one copy (`kernels.upload`); the runtime then only reads it: no layer builds an index, checks it again or
reads the device back.

Invariants: every array is a numpy array until `to`, a tensor on one device after; everything a kernel
reads is built here, nothing downstream is re-derived. Cost: O(T log T + rows x len + attention blocks).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .index import MicrobatchIndex, PieceRows
from .kernels.causal_conv import ConvIndex, prepare_conv_index
from .kernels.chunk_gdn import CHUNK_SIZE, GDNKernelConfig, TreeGDNPlan, plan_tree_gdn
from .kernels.logprobs import TargetPlan, target_plan_of
from .kernels.tree_attention import BlockIndex, build_block_index, query_windows
from .kernels.upload import to_device


class PlanMismatchError(ValueError):
    """A plan and the model it is run on disagree (the message names the field and both values)."""


@dataclasses.dataclass(frozen=True)
class LaunchTarget:
    """What a model needs from a launch plan: its sizes and, per op family, whether Triton kernels run it."""
    vocab_size: int
    conv_width: int
    gdn_triton: bool = False        # Triton GDN kernels (chunk size CHUNK_SIZE); else the plain-torch reference
    conv_triton: bool = False       # Triton tree causal conv; else its reference
    attention_tiles: tuple[tuple[int, int], ...] = ()  # Triton tree attention at these tiles; () = torch path
    logprobs_triton: bool = False   # Triton element-wise log-prob kernels
    embed_triton: bool = False      # the embedding backward as one segment_add launch (no device read)
    gdn_config: GDNKernelConfig = GDNKernelConfig()
    logprob_chunk_tokens: int = 4096
    attention_query_block: int = 256  # the torch attention path's query block

    @property
    def chunk_size(self) -> int | None:
        """The GDN chunk size the model's kernels run, None = any (the reference takes the plan's)."""
        return CHUNK_SIZE if self.gdn_triton else None


@dataclasses.dataclass(frozen=True)
class PieceLaunch(PieceRows):
    """A piece's carried rows (codegen.index.PieceContext), as the runtime reads them: keys = `num_keys` context
    keys then the own tokens; conv inputs and linear-attention rows beyond the own tokens come carried; the
    carried states are the GDN plan's caller states and its returned states the ones later pieces read."""
    num_keys: int


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything one microbatch's forward and backward read, for one `LaunchTarget`."""
    target: LaunchTarget
    trajectory_ids: tuple[str, ...]
    chunk_size: int
    conv_width: int
    token_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64, RoPE positions
    multiplicity: np.ndarray     # [T] int64, trajectories through the token (MoE statistics)
    conv_pred: np.ndarray        # [T (+ carried conv rows), W-1] int64, path predecessors (-1 before position 0)
    subtree_end: np.ndarray      # [keys] int32, tree mask (keys = the own tokens, after a piece's context keys)
    lengths: np.ndarray          # [rows] int64
    # the embedding's backward: compact tokens grouped by id (stable), the distinct ids and their bounds
    embed_order: np.ndarray      # [T] int64
    embed_ids: np.ndarray        # [U] int64
    embed_bounds: np.ndarray     # [U+1] int64
    gdn: TreeGDNPlan             # every round of the linear-attention layers
    targets: TargetPlan          # log-prob chunks and the row gathers
    conv: ConvIndex | None       # successor lists of the Triton conv's backward (None: torch path)
    attention: BlockIndex | None  # block lists at every tile of target.attention_tiles (None: torch path)
    windows: tuple[tuple[int, int, int], ...]  # torch attention path: (start, end, first open key) per block
    piece: PieceLaunch | None = None  # a piece of a split tree: what it reads from / keeps for other pieces

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def device(self) -> torch.device | None:
        """The device of an uploaded plan, None on the host."""
        return self.token_ids.device if isinstance(self.token_ids, torch.Tensor) else None

    def to(self, device) -> "LaunchPlan":
        """The plan on `device`, in one host-to-device copy (asynchronous from pinned memory on CUDA)."""
        return to_device(self, device)


def _check_target(index: MicrobatchIndex, target: LaunchTarget) -> None:
    if index.conv_width != target.conv_width:
        raise PlanMismatchError(f"plan conv_width={index.conv_width} but the model's linear_conv_kernel_dim is "
                                f"{target.conv_width}: compile with CompileOptions.for_model(model)")
    if target.chunk_size is not None and index.chunk_size != target.chunk_size:
        raise PlanMismatchError(f"plan chunk_size={index.chunk_size} but the model's Triton GDN kernels run "
                                f"chunk_size={target.chunk_size}: compile with CompileOptions.for_model(model)")
    if index.chunk_size <= 0:
        raise PlanMismatchError(f"plan chunk_size={index.chunk_size} must be positive")
    tokens = index.token_ids
    if tokens.size and (tokens.min() < 0 or tokens.max() >= target.vocab_size):
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise PlanMismatchError(f"MicrobatchIndex.token_ids: token id {bad} is outside the model's vocabulary "
                                f"[0, {target.vocab_size})")


def gdn_plan(index: MicrobatchIndex, config=None):
    """The linear-attention plan (chunk_gdn.TreeGDNPlan) of `index`'s rounds. A piece's rows are its own tokens
    followed by the replay rows it reads from earlier pieces, and its sequences may start from carried states."""
    ctx = index.context
    return plan_tree_gdn(index.rounds, index.num_tokens + (0 if ctx is None else ctx.replay_rows),
                         chunk_size=index.chunk_size, config=config, num_initial=0 if ctx is None else ctx.num_states,
                         output_banks=() if ctx is None else ctx.state_out)


def lower(index: MicrobatchIndex, target: LaunchTarget) -> LaunchPlan:
    """The launch plan of `index` for `target`, built and verified on the host (see the module docstring).
    Raises PlanMismatchError where plan and model disagree, ValueError naming the field for a bad index."""
    if not isinstance(index, MicrobatchIndex):
        raise TypeError(f"lower: expected a MicrobatchIndex, got {type(index).__name__}")
    # a copy whose fields are host arrays again, whatever was assigned to them since construction
    index = dataclasses.replace(index, rounds=[dataclasses.replace(r) for r in index.rounds])
    _check_target(index, target)
    index.check()
    ctx = index.context
    piece = None if ctx is None else PieceLaunch(
        num_keys=ctx.num_keys, **{field.name: getattr(ctx, field.name) for field in dataclasses.fields(PieceRows)})
    gdn = gdn_plan(index, target.gdn_config)
    keys = index.subtree_end if ctx is None else np.concatenate([ctx.kv_subtree_end, index.subtree_end])
    subtree_end = keys.astype(np.int32)
    queries = None if ctx is None else index.num_tokens  # a piece's queries are the last T keys
    attention = None
    if target.attention_tiles:
        first = target.attention_tiles[0]
        extra = {} if queries is None else {"num_queries": queries}
        attention = build_block_index(subtree_end, *first, **extra).with_tiles(subtree_end,
                                                                               target.attention_tiles[1:])
    windows = () if target.attention_tiles else query_windows(subtree_end, target.attention_query_block,
                                                              num_queries=queries)
    embed_order = np.argsort(index.token_ids, kind="stable").astype(np.int64)
    embed_ids, embed_counts = np.unique(index.token_ids[embed_order], return_counts=True)
    return LaunchPlan(
        target=target, trajectory_ids=tuple(index.trajectory_ids), chunk_size=index.chunk_size,
        conv_width=index.conv_width, token_ids=index.token_ids, positions=index.positions,
        multiplicity=index.multiplicity, conv_pred=index.conv_pred, subtree_end=subtree_end, lengths=index.lengths,
        embed_order=embed_order, embed_ids=embed_ids.astype(np.int64),
        embed_bounds=np.r_[0, np.cumsum(embed_counts)].astype(np.int64), gdn=gdn,
        targets=target_plan_of(index, target.vocab_size, target.logprob_chunk_tokens,
                               triton=target.logprobs_triton),
        conv=prepare_conv_index(index.conv_pred) if target.conv_triton else None,
        attention=attention, windows=windows, piece=piece)
