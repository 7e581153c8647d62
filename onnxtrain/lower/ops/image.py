"""ImageDecoder: decoding runs on the host with Pillow (the optional `images` extra), on static bytes."""

from __future__ import annotations

import io

import numpy as np

from ...errors import NodeError
from ..registry import op, versions
from ..values import static


@op("ImageDecoder", *versions("ImageDecoder"))
def image_decoder(encoded, *, pixel_format: str = "RGB"):
    """(H, W, C) uint8; an undecodable stream gives an empty array, as the spec says."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise NodeError("ImageDecoder needs Pillow: pip install 'onnxtrain[images]'") from None
    if pixel_format not in ("RGB", "BGR", "Grayscale"):
        raise NodeError(f"ImageDecoder: pixel_format must be RGB, BGR or Grayscale, got {pixel_format!r}")
    data = static(encoded, "encoded_stream").astype(np.uint8).tobytes()
    try:
        image = Image.open(io.BytesIO(data))
        image = image.convert("L" if pixel_format == "Grayscale" else "RGB")
    except (UnidentifiedImageError, OSError):
        return np.zeros((0, 0, 1 if pixel_format == "Grayscale" else 3), np.uint8)
    pixels = np.asarray(image, dtype=np.uint8)
    if pixel_format == "Grayscale":
        return pixels[:, :, None]
    return np.ascontiguousarray(pixels[:, :, ::-1]) if pixel_format == "BGR" else pixels
