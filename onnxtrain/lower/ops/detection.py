"""NonMaxSuppression. Its output length depends on the data, so it runs in NumPy on static inputs (the engine
compiles fed boxes/scores in as constants); a traced input is a clear StaticValueRequired error."""

from __future__ import annotations

import numpy as np

from ..registry import op, versions
from ..values import static


def corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """Boxes as (y_min, x_min, y_max, x_max), whichever diagonal or center form they came in."""
    if center_point_box:
        xc, yc, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def iou_matrix(boxes: np.ndarray) -> np.ndarray:
    """Pairwise intersection over union; a pair with an empty box or no overlap has IoU 0."""
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    top_left = np.maximum(boxes[:, None, :2], boxes[None, :, :2])
    bottom_right = np.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    extent = np.clip(bottom_right - top_left, 0, None)
    inter = extent[..., 0] * extent[..., 1]
    union = area[:, None] + area[None, :] - inter
    valid = (area[:, None] > 0) & (area[None, :] > 0) & (inter > 0) & (union > 0)
    return np.where(valid, inter / np.where(union > 0, union, 1), 0.0)


def optional_scalar(value, what: str, default):
    """An optional scalar input: absent or empty means the default."""
    if value is None or not np.size(value):
        return default
    return static(value, what).reshape(-1)[0].item()


@op("NonMaxSuppression", *versions("NonMaxSuppression"))
def non_max_suppression(
    boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None, *,
    center_point_box: int = 0,
):
    boxes = static(boxes, "boxes").astype(np.float64)
    scores = static(scores, "scores")
    limit = optional_scalar(max_output_boxes_per_class, "max_output_boxes_per_class", 0)
    iou_limit = optional_scalar(iou_threshold, "iou_threshold", 0.0)
    min_score = optional_scalar(score_threshold, "score_threshold", None)
    selected: list[tuple[int, int, int]] = []
    for batch in range(boxes.shape[0]):
        iou = iou_matrix(corners(boxes[batch], center_point_box))
        for cls in range(scores.shape[1]):
            class_scores = scores[batch, cls]
            order = np.argsort(-class_scores, kind="stable")  # ties: the lower box index first
            if min_score is not None:
                order = order[class_scores[order] > min_score]
            kept: list[int] = []
            for box in order:
                if len(kept) >= limit:
                    break
                if not kept or not (iou[box, kept] > iou_limit).any():
                    kept.append(int(box))
            selected += [(batch, cls, box) for box in kept]
    return np.array(selected, dtype=np.int64).reshape(-1, 3)
