"""DeepSeek-V4's release formats, written with torch as the release's own quantiser would: FP8 e4m3 with one
ue8m0 scale per 128x128 block, and FP4 e2m1 experts (two codes per int8 byte, low nibble first) with one ue8m0
scale per 32 values of a row. Shared by tests/test_deepseek_v4.py and bench/hf_tiny_v4.py (the MaxText
comparison's tiny release), so the test's release and the benchmark's are quantised alike."""

from __future__ import annotations

import numpy as np
import torch

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def ue8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power-of-two scale that maps ``amax`` into the format's range (ue8m0: round the scale up)."""
    return torch.pow(2.0, torch.ceil(torch.log2(torch.where(amax > 0, amax / top, torch.ones_like(amax)))))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float8_e8m0fnu scale per 128x128 block)."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(br, 128, bc, 128)
    scale = ue8m0(blocks.abs().amax(dim=(1, 3)), 448.0)
    codes = (blocks / scale[:, None, :, None]).reshape(br * 128, bc * 128)[:rows, :cols]
    return codes.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor, negative_zero_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 of two e2m1 codes, float8_e8m0fnu scale per 32 values of a row). ``negative_zero_column``: the first
    column's codes set to -0.0, which MaxText's DeepSeek dequantiser keeps negative (a test of that bit)."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    scale = ue8m0(groups.abs().amax(dim=2), 6.0)
    values = (groups / scale[:, :, None]).reshape(rows, cols)
    codes = (values[..., None] - torch.from_numpy(E2M1)).abs().argmin(dim=-1).to(torch.uint8)  # nearest e2m1 code
    if negative_zero_column:
        codes[:, 0] = 8
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """The float32 values a release tensor stands for: FP4 (int8, two e2m1 codes a byte) times its scale per 32
    values of a row, or FP8 times its scale per 128x128 block (the reference the tests hold a decode to)."""
    s = scale.float().numpy()
    if codes.dtype == torch.int8:
        u8 = codes.view(torch.uint8).numpy()
        values = np.stack([E2M1[u8 & 15], E2M1[u8 >> 4]], axis=-1).reshape(u8.shape[0], -1)
        return values * np.repeat(s, 32, axis=1)
    values = codes.float().numpy()
    return values * np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:values.shape[0], :values.shape[1]]
