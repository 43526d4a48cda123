"""evaluation/group_quant.py (an issue-13 experiment): low-bit keys on grids shared by several blocks or with one step
per token. Over one block the channel grid is ``QuantBlockTopK``'s; wider grids and per-token steps keep every valid
key within half a step; invalid positions never move a grid."""

from __future__ import annotations

import pytest
import torch

from evaluation.group_quant import GroupQuantBlockTopK, extra_cells, group_quant_keys
from hf_sparse_kv.ops import reference as R

pytestmark = pytest.mark.usefixtures("one_thread")

B, MB, H, BS, D = 2, 5, 2, 8, 16


def _keys(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, MB, H, BS, D, generator=g) * torch.linspace(0.2, 5, D)
    table = torch.tensor([[3, 7, 1, 9, 2], [4, -1, 5, 0, 6]], dtype=torch.int32)
    ok = R.held_positions(table, torch.tensor([37, 33]), torch.tensor([0, 5]), BS)  # [B, MB, BS]
    return keys, ok


def test_one_block_grid_is_quant_block_topks():
    """``scheme="channel"``, one block: each block's min / max grid, as ``quantize_keys`` / ``dequantize_keys``."""
    keys, ok = _keys()
    got = group_quant_keys(keys, ok, 4, "channel", 1)
    m = ok[:, :, None, :, None]
    lo = keys.masked_fill(~m, float("inf")).amin(3)
    hi = keys.masked_fill(~m, float("-inf")).amax(3)
    full = ok.all(-1)  # blocks with every position valid: the library's grid over the whole block
    want = R.dequantize_keys(R.quantize_keys(keys, lo, hi, 4), lo, hi, 4)
    torch.testing.assert_close(got[full], want[full], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scheme,g", [("channel", 1), ("channel", 2), ("channel", 16), ("token", 1)])
@pytest.mark.parametrize("bits", [2, 4])
def test_valid_keys_within_half_a_step_and_invalid_ones_untouched(scheme, g, bits):
    keys, ok = _keys(1)
    got = group_quant_keys(keys, ok, bits, scheme, g)
    m = ok[:, :, None, :].expand(B, MB, H, BS)
    assert torch.equal(got[~m], keys[~m])
    err = (got - keys).abs()[m]  # [n, D]
    L = 2**bits - 1
    if scheme == "token":  # each token's step: its largest offset from the block's channel minima over L
        lo = keys.masked_fill(~ok[:, :, None, :, None], float("inf")).amin(3, keepdim=True)
        step = ((keys - lo).amax(-1) / L)[m]
        assert (err <= step[:, None] / 2 + 1e-5).all()
    else:  # the widest range of any channel over its group bounds the step
        assert (err <= (keys[m].amax(0) - keys[m].amin(0)).max() / L / 2 + 1e-5).all()
    # a wrong value at an invalid position moves no grid
    spoiled = keys.masked_fill(~ok[:, :, None, :, None], 1e6)
    assert torch.equal(group_quant_keys(spoiled, ok, bits, scheme, g)[m], got[m])


def test_policy_checks_its_arguments_and_the_screen_has_its_cells():
    with pytest.raises(ValueError, match="scheme"):
        GroupQuantBlockTopK(budget=0.25, scheme="rows")
    with pytest.raises(ValueError, match="group_blocks"):
        GroupQuantBlockTopK(budget=0.25, group_blocks=0)
    cells = extra_cells(1 / 16, 4, 32)
    assert set(cells) == {"gq4_1", "gq4_4", "gq4_16", "tq4", "gq2_1", "gq2_4", "gq2_16", "tq2", "fp8", "fp8t"}
    assert cells["fp8"].scheme == "fp8" and cells["fp8t"].scheme == "fp8_token"
    assert cells["tq4"].scheme == "token" and cells["gq2_16"].group_blocks == 16 and cells["gq2_16"].bits == 2


def test_fp8_keys_within_e4m3_rounding_of_their_channel_scale_and_invalid_ones_untouched():
    """``scheme="fp8"``: each valid key is its e4m3 rounding after dividing by its channel's scale (``max |k| /
    448`` over the valid keys of its sequence and head): within 2^-4 of itself relatively, or one subnormal step
    (2^-9 of the scale) near zero; the channel's largest key is exact; invalid positions move no scale."""
    keys, ok = _keys(2)
    got = group_quant_keys(keys, ok, 4, "fp8")
    m5 = ok[:, :, None, :, None].expand_as(keys)
    assert torch.equal(got[~m5], keys[~m5])
    amax = keys.abs().masked_fill(~m5, 0.0).amax(dim=(1, 3), keepdim=True)
    scale = (amax / 448).expand_as(keys)
    err = (got - keys).abs()
    bound = torch.maximum(keys.abs() * 2.0**-4, scale * 2.0**-9)
    assert (err[m5] <= bound[m5] * (1 + 1e-6)).all()
    assert (err[m5] > 0).any()  # it did round something
    top = keys.abs().masked_fill(~m5, -1.0) == amax  # each channel's largest valid |key|: 448 exactly
    assert torch.allclose(got[top], keys[top])
    spoiled = keys.masked_fill(~ok[:, :, None, :, None], 1e6)
    assert torch.equal(group_quant_keys(spoiled, ok, 4, "fp8")[m5], got[m5])


def test_fp8_token_keys_are_the_librarys_codes():
    """``scheme="fp8_token"``: each valid key decoded from ``reference.fp8_code`` (its own scale), as the cache of
    ``Fp8BlockTopK`` holds it; invalid positions untouched."""
    keys, ok = _keys(3)
    got = group_quant_keys(keys, ok, 4, "fp8_token")
    m5 = ok[:, :, None, :, None].expand_as(keys)
    assert torch.equal(got[~m5], keys[~m5])
    assert torch.equal(got[m5], R.fp8_decode(*R.fp8_code(keys))[m5])
    assert ((got - keys).abs()[m5] <= keys.abs()[m5] * 2.0**-4 + keys.abs().amax() * 2.0**-18).all()
