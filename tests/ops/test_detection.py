import numpy as np
import pytest

import onnxtrain
from nodes import node_model
from onnxtrain.errors import StaticValueRequired


def numpy_nms(boxes, scores, limit, iou_threshold):
    """Greedy NMS written from the definition: highest score first, drop boxes overlapping a kept one."""
    out = []
    for c in range(scores.shape[1]):
        kept = []
        for i in sorted(range(len(boxes[0])), key=lambda i: (-scores[0, c, i], i)):
            y1, x1, y2, x2 = boxes[0, i]
            ok = True
            for j in kept:
                b1, a1, b2, a2 = boxes[0, j]
                inter = max(0, min(y2, b2) - max(y1, b1)) * max(0, min(x2, a2) - max(x1, a1))
                union = (y2 - y1) * (x2 - x1) + (b2 - b1) * (a2 - a1) - inter
                ok &= inter / union <= iou_threshold
            if ok and len(kept) < limit:
                kept.append(i)
        out += [(0, c, i) for i in kept]
    return np.array(out, np.int64)


def test_random_boxes_match_a_definition_written_in_numpy():
    rng = np.random.default_rng(0)
    corner = rng.uniform(0, 10, size=(1, 40, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(0.5, 4, size=(1, 40, 2))], axis=-1).astype(np.float32)
    scores = rng.random((1, 2, 40)).astype(np.float32)
    feeds = {"boxes": boxes, "scores": scores, "limit": np.array([5], np.int64), "iou": np.array([0.3], np.float32)}
    engine = onnxtrain.load(node_model("NonMaxSuppression", feeds), check=False)
    with pytest.warns(UserWarning, match="compiled in as constants"):
        got = np.asarray(engine.infer(feeds)["out0"])
    np.testing.assert_array_equal(got, numpy_nms(boxes.astype(np.float64), scores, 5, 0.3))


def test_traced_boxes_inside_a_graph_are_a_clear_error():
    import jax

    from onnxtrain.lower.ops.detection import non_max_suppression

    with pytest.raises(StaticValueRequired, match="'boxes'"):
        jax.jit(lambda b: non_max_suppression(b, np.ones((1, 1, 2), np.float32)))(np.zeros((1, 2, 4), np.float32))
