"""Heatmaps as self-contained PNG data URIs: a tiny pure-numpy PNG encoder (zlib), no matplotlib."""
from __future__ import annotations

import base64
import struct
import zlib
from typing import Optional

import numpy as np

# viridis anchors (0, .25, .5, .75, 1)
_ANCHORS = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
_NAN_RGB = (255, 0, 255)  # non-finite cells: magenta, never a colour of the scale


def encode_png(rgb: np.ndarray) -> bytes:
    """(H, W, 3) uint8 -> PNG bytes (8-bit RGB, no interlace, filter 0 per row)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise ValueError(f"encode_png: expected an (H, W, 3) image with H, W >= 1, got {rgb.shape}")
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def colorize(values: np.ndarray, vmax: Optional[float] = None) -> np.ndarray:
    """2-D array -> (H, W, 3) uint8 with a linear viridis scale from 0 to vmax; NaN/Inf in magenta."""
    a = np.asarray(values, dtype=np.float64)
    fin = np.isfinite(a)
    top = vmax if vmax is not None else (float(np.max(a[fin])) if fin.any() else 1.0)
    top = top if top > 0 else 1.0
    x = np.clip(np.where(fin, a, 0.0) / top, 0.0, 1.0) * (len(_ANCHORS) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_ANCHORS) - 2)
    f = (x - lo)[..., None]
    rgb = _ANCHORS[lo] * (1 - f) + _ANCHORS[lo + 1] * f
    rgb[~fin] = _NAN_RGB
    return rgb.round().astype(np.uint8)


def upscale(rgb: np.ndarray, target_width: int = 480, max_cell: int = 24, target_height: int = 480) -> np.ndarray:
    """Nearest-neighbour blow-up so small grids are visible (each cell a sy x sx block)."""
    h, w, _ = rgb.shape
    sx = max(1, min(max_cell, target_width // max(w, 1)))
    sy = max(1, min(max_cell, target_height // max(h, 1)))
    return np.repeat(np.repeat(rgb, sy, axis=0), sx, axis=1)


def heatmap_data_uri(values, vmax: Optional[float] = None) -> str:
    """2-D values -> 'data:image/png;base64,...' (viridis, NaN magenta, upscaled)."""
    a = np.asarray(values, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.size == 0:
        a = np.zeros((1, 1))
    png = encode_png(upscale(colorize(a, vmax)))
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def colorbar_data_uri(width: int = 160, height: int = 12) -> str:
    ramp = np.linspace(0, 1, width)[None, :].repeat(height, 0)
    return "data:image/png;base64," + base64.b64encode(encode_png(colorize(ramp, 1.0))).decode("ascii")
