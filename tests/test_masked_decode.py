"""The GPU backend's mask mode (SDPA over the gathered pages) against the float32 reference."""

import pytest
import torch

from hf_sparse_kv.ops import reference
from hf_sparse_kv.ops.triton.masked_decode import decode_masked

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_masked_decode_matches_reference(device, dtype, tol, G):
    torch.manual_seed(G)
    B, Hkv, D, BS, NB = 3, 2, 32, 8, 24
    k_pool = torch.randn(NB, Hkv, BS, D, device=device).to(dtype)
    v_pool = torch.randn(NB, Hkv, BS, D, device=device).to(dtype)
    table = torch.randperm(NB, device=device)[: B * 6].view(B, 6).int()
    lens = torch.tensor([45, 17, 30], device=device)
    q = torch.randn(B, Hkv * G, D, device=device).to(dtype)
    mask = torch.rand(B, Hkv, 45, device=device) > 0.4
    mask &= torch.arange(45, device=device) < lens.view(-1, 1, 1)
    mask[2, 1] = False  # nothing to attend: 0, not NaN
    ref = reference.decode_masked(q, k_pool, v_pool, table, lens, mask, 0.3).float()
    out = decode_masked(q, k_pool, v_pool, table, lens, mask, 0.3).float()
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < tol
    assert out[2, G:].abs().max().item() == 0.0
