import io

import numpy as np
import pytest

import onnxtrain
from nodes import node_model

Image = pytest.importorskip("PIL.Image")


def png_bytes(pixels: np.ndarray) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return np.frombuffer(buffer.getvalue(), np.uint8)


@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_png_round_trip(pixel_format):
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    feeds = {"data": png_bytes(pixels)}
    engine = onnxtrain.load(node_model("ImageDecoder", feeds, pixel_format=pixel_format), check=False)
    with pytest.warns(UserWarning):
        got = np.asarray(engine.infer(feeds)["out0"])
    expected = {"RGB": pixels, "BGR": pixels[:, :, ::-1],
                "Grayscale": np.asarray(Image.fromarray(pixels).convert("L"))[:, :, None]}[pixel_format]
    np.testing.assert_array_equal(got, expected)


def test_undecodable_stream_gives_an_empty_image():
    feeds = {"data": np.frombuffer(b"not an image", np.uint8)}
    engine = onnxtrain.load(node_model("ImageDecoder", feeds), check=False)
    with pytest.warns(UserWarning):
        assert np.asarray(engine.infer(feeds)["out0"]).shape == (0, 0, 3)
