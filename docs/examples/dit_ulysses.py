"""A DiT self-attention layer under Ulysses sequence parallelism (see docs/parallel.md).

    torchrun --nproc-per-node 4 docs/examples/dit_ulysses.py            # 4 GPUs, NVFP4
    torchrun --nproc-per-node 2 docs/examples/dit_ulysses.py --cpu      # CPU, gloo, reference

Every rank holds a quarter of the tokens of the packed sequence ``[text | audio | video]`` for
the MLPs; the layer projects its own tokens to q, k, v (all heads), ``ulysses_attention`` runs
attention on a quarter of the heads of *all* tokens, and the output projection runs on the
rank's tokens again. The script checks the sharded layer against the same layer on one device.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from flashinfer_h3.parallel import gather_sequence, shard_sequence, ulysses_attention
from flashinfer_h3.reference import varlen_attention_nvfp4_reference


class UlyssesSelfAttention(nn.Module):
    """Full (non-causal) self-attention of a DiT block over a packed, sequence-sharded input.

    ``forward(x, cu_seqlens, cu_seqlens_host)``: ``x`` is this rank's shard ``[ceil(T / W), dim]``
    of the packed sequence (rank ``r`` holds rows ``[r*Tl, (r+1)*Tl)``; ``shard_sequence`` cuts
    it), ``cu_seqlens`` / ``cu_seqlens_host`` the *global* segment bounds. Returns the shard of
    the output, ``[ceil(T / W), dim]``. With ``group`` of size 1 (or no process group) this is
    the plain single-GPU layer.
    """

    def __init__(self, dim: int, heads: int, head_dim: int = 128, *,
                 group: dist.ProcessGroup | None = None, precision: str = "nvfp4",
                 attention=None) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.group, self.precision, self.attention = group, precision, attention
        self.to_q = nn.Linear(dim, heads * head_dim)
        self.to_k = nn.Linear(dim, heads * head_dim)
        self.to_v = nn.Linear(dim, heads * head_dim)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)  # QK-norm, as in MiniMax-H3's blocks
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.to_out = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor,
                cu_seqlens_host: list[int]) -> torch.Tensor:
        t = x.shape[0]
        shape = (t, self.heads, self.head_dim)
        # Separate projections give contiguous [t, heads, 128] tensors: no copy before the
        # all-to-all (a fused qkv Linear would need one per tensor to split its output).
        q = self.norm_q(self.to_q(x).view(shape))
        k = self.norm_k(self.to_k(x).view(shape))
        v = self.to_v(x).view(shape)
        # (3D RoPE of this rank's token positions would be applied to q and k here.)
        o = ulysses_attention(q, k, v, cu_seqlens, group=self.group, precision=self.precision,
                              attention=self.attention, cu_seqlens_host=cu_seqlens_host)
        return self.to_out(o.view(t, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="gloo and the torch reference of the NVFP4 recipe, a small shape")
    args = parser.parse_args()

    if args.cpu:
        dist.init_process_group("gloo")
        device, attention = torch.device("cpu"), varlen_attention_nvfp4_reference
        dim, heads, lengths = 256, 4, [24, 0, 75, 150]  # text | (no audio) | video frames
    else:
        # cpu:gloo carries ulysses_attention's cross-rank argument check on the host (no sync).
        dist.init_process_group("cpu:gloo,cuda:nccl")
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device, attention = torch.device("cuda", torch.cuda.current_device()), None
        dim, heads, lengths = 7168, 56, [512, 4096, 57344]  # MiniMax-H3: 56 heads x 128
    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)

    torch.manual_seed(0)  # the same weights and input on every rank
    layer = UlyssesSelfAttention(dim, heads, attention=attention).to(device, torch.bfloat16)
    x = torch.randn(bounds[-1], dim, device=device, dtype=torch.bfloat16)

    with torch.no_grad():
        y_local = layer(shard_sequence(x), cu_seqlens, bounds)  # [ceil(T / W), dim]
        y = gather_sequence(y_local, bounds[-1])  # [T, dim] on every rank
        # The same layer on one device (a group of one: the operator, called directly).
        alone, _ = dist.new_subgroups(group_size=1)
        single = UlyssesSelfAttention(dim, heads, group=alone,
                                      attention=attention).to(device, torch.bfloat16)
        single.load_state_dict(layer.state_dict())
        y_one = single(x, cu_seqlens, bounds)
    # Attention is per head, so ulysses_attention itself is bit-exact (tests/unit/
    # test_parallel_gloo.py); the Linear layers may round a [T/W, dim] and a [T, dim] product
    # differently (BLAS tiling), which low-precision attention can amplify a little.
    rel = ((y.float() - y_one.float()).norm() / y_one.float().norm()).item()
    if rank == 0:
        print(f"W = {world}: {bounds[-1]} tokens x {heads} heads; sharded vs single-device "
              f"layer: {'identical' if torch.equal(y, y_one) else f'relative L2 {rel:.2e}'}")
    dist.destroy_process_group()
    if rel > 1e-2:
        raise SystemExit(f"the sharded layer differs from the single-device one ({rel:.3f})")


if __name__ == "__main__":
    main()
