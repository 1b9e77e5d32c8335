"""GPU checks beside the sweeps: the asm MXFP4 dequantization bit-exact, and a graph-captured gemv call."""
import torch
import k3lab  # noqa: F401
from k3lab import mxfp4
from k3lab_kernels.triton.moe_experts import mxfp4_dequant

g = torch.Generator().manual_seed(0)
p = torch.arange(256, dtype=torch.uint8).repeat(16, 2)
top = torch.randint(10, 255, (16, 1), generator=g)
top[0], top[1] = 10, 254
s = (top - torch.randint(0, 30, (16, 32), generator=g)).clamp(min=0)
s[:, 0] = top[:, 0]
s = s.to(torch.uint8)
got = mxfp4_dequant(p.cuda(), s.cuda()).cpu()
want = mxfp4.unpack_mxfp4(p, s)
print("mxfp4 dequant bit-exact on GPU:", torch.equal(got.view(torch.int32), want.view(torch.int32)),
      "mismatches", int((got.view(torch.int32) != want.view(torch.int32)).sum()))

# the simt path (ninth session): its kernel layout, decode and block factor, every code pair under scales 0..240
from k3lab_kernels.triton.moe_experts import mxfp4_dequant_simt  # noqa: E402

s2 = torch.randint(0, 241, (16, 32), generator=g).to(torch.uint8)
got = mxfp4_dequant_simt(mxfp4.to_kernel_layout(p).cuda(), s2.cuda()).cpu()
want = mxfp4.unpack_mxfp4(p, s2)
print("mxfp4 simt dequant bit-exact on GPU:", torch.equal(got.view(torch.int32), want.view(torch.int32)),
      "mismatches", int((got.view(torch.int32) != want.view(torch.int32)).sum()))
