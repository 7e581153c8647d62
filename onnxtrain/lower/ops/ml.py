"""The ai.onnx.ml domain: preprocessing, encoders, maps (linear models and SVMs: ml_models.py; tree ensembles:
ml_trees.py).

Model parameters are attributes, hence static NumPy; the data they apply to may be traced and is handled with
jax.numpy. Strings exist only on the host: an op whose input or output is a string tensor computes in NumPy,
and one that turns traced numbers into strings (a classifier with string labels, an int -> string LabelEncoder)
reads its input with `static()`, so the engine compiles that input in as a constant.

Maps are Python dicts and seq(map) values are Python lists of dicts. A map fed from outside may also arrive as
a 0-d NumPy object array holding the dict (how feeds are converted). ZipMap's values are float32 scalars, or
tracers when its input is traced: a list of dicts is a pytree, so it can leave a jitted function as it is.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...errors import StaticValueRequired
from ..registry import ML_DOMAIN, op, versions
from ..values import Value, is_static, is_text, static

POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")  # TreeEnsemble's codes index this


def ml_op(name: str, since: int = 1, until: int | None = None) -> Callable[[Callable], Callable]:
    """Register a lowering of ai.onnx.ml::`name` for every since_version of its schema in [since, until]."""
    return op(name, *versions(name, since=since, until=until, domain=ML_DOMAIN), domain=ML_DOMAIN)


def as_float(x: Value) -> Value:
    """Scores are computed in float32 (as ONNX Runtime does) unless the input is float64."""
    x = x if isinstance(x, np.ndarray) else jnp.asarray(x)
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)


def as_rows(x: Value) -> Value:
    """A [F] input is one sample: [1, F]."""
    return x.reshape(1, -1) if x.ndim == 1 else x


def matmul_weights(x: Value, weights: np.ndarray) -> Value:
    # Full precision: accelerators otherwise round float32 matmuls, which flips close classifier decisions.
    return jnp.matmul(x, jnp.asarray(weights, x.dtype), precision=lax.Precision.HIGHEST)


def float_attr(values: Sequence[float] | None, dtype: Any, default: Sequence[float] = ()) -> np.ndarray:
    return np.asarray(default if values is None or len(values) == 0 else values, dtype=dtype)


# ---- post transforms and class labels (shared with ml_trees) -------------------------------------------------


def transform_scores(scores: Value, name: str) -> Value:
    """The score transform of the ml classifiers and regressors, along the last axis."""
    if name == "NONE":
        return scores
    if name == "LOGISTIC":
        return jax.nn.sigmoid(scores)
    if name == "SOFTMAX":
        return jax.nn.softmax(scores, axis=-1)
    if name == "SOFTMAX_ZERO":
        return _softmax_zero(scores)
    if name == "PROBIT":
        return probit(scores)
    raise ValueError(f"unknown post_transform {name!r}; expected one of {list(POST_TRANSFORMS)}")


def _softmax_zero(scores: Value) -> Value:
    """Softmax in which a zero score keeps (almost) no mass; a row with no mass at all becomes 0.5s."""
    top = jnp.max(scores, axis=-1, keepdims=True)
    mass = jnp.where(jnp.abs(scores) > 1e-7, jnp.exp(scores - top), scores * jnp.exp(-top))
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return jnp.where(total == 0, jnp.asarray(0.5, scores.dtype), mass / jnp.where(total == 0, 1, total))


def probit(p: Value) -> Value:
    """sqrt(2) erfinv(2p - 1) with Winitzki's closed-form erfinv (a = 0.147): ONNX Runtime and ONNX's reference
    evaluator both use this approximation, and an exact erfinv would differ from them by up to ~1e-3."""
    x = 2 * p - 1
    one_minus_square = (1 - x) * (1 + x)  # negative (so NaN below) outside the domain, p in [0, 1]
    log = jnp.log(jnp.where(one_minus_square == 0, 1, one_minus_square))
    a = 0.147
    v = 2 / (math.pi * a) + 0.5 * log
    # This cancels badly near p = 0.5; both implementations compute it in float32, in this order.
    root = jnp.sqrt(-v + jnp.sqrt(v * v - (1 / a) * log))  # 0 at p = 0 or 1, as theirs gives there
    return (1.41421356 * jnp.where(x < 0, -root, root)).astype(p.dtype)


def class_labels(ints: Sequence[int] | None, strings: Sequence[str] | None) -> np.ndarray:
    """The classlabels_* attribute that is set: int64 or object (string) NumPy array; empty when neither is."""
    if strings:
        return np.asarray(strings, dtype=object)
    return np.asarray(ints or [], dtype=np.int64)


def classifier_input(x: Value, labels: np.ndarray) -> Value:
    """String labels can only be produced on the host, so they need the features' values at trace time."""
    return static(x, "X") if labels.dtype == object else x


def pick(labels: np.ndarray, index: Value) -> Value:
    """labels[index]: a gather on the device for int64 labels, a host lookup for strings."""
    if labels.dtype == object:
        return labels[np.asarray(index)]
    return jnp.asarray(labels)[index]


# ---- elementwise preprocessing -------------------------------------------------------------------------------


@ml_op("Binarizer")
def binarizer(X: Value, *, threshold: float = 0.0) -> Value:
    return jnp.where(X > threshold, 1, 0).astype(X.dtype)


@ml_op("Scaler")
def scaler(X: Value, *, offset: list[float] | None = None, scale: list[float] | None = None) -> Value:
    x = as_float(X)
    shifted = x - float_attr(offset, x.dtype, [0.0])  # one value per feature (last axis), or one for all
    return (shifted * float_attr(scale, x.dtype, [1.0])).astype(np.float32)


@ml_op("Normalizer")
def normalizer(X: Value, *, norm: str = "MAX") -> Value:
    """Each row (last axis) divided by its max, L1 or L2 norm; a row whose divisor is zero is left as it is.
    MAX divides by max(X) as the spec (and ONNX Runtime) say, not by max(|X|) as ONNX's reference does."""
    x = as_float(X)
    divisors = {
        "MAX": lambda: jnp.max(x, axis=-1, keepdims=True),
        "L1": lambda: jnp.sum(jnp.abs(x), axis=-1, keepdims=True),
        "L2": lambda: jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)),
    }
    if norm not in divisors:
        raise ValueError(f"unknown norm {norm!r}; expected one of {list(divisors)}")
    divisor = divisors[norm]()
    return (x / jnp.where(divisor == 0, 1, divisor)).astype(np.float32)


@ml_op("Imputer")
def imputer(
    X: Value,
    *,
    imputed_value_floats: list[float] | None = None,
    imputed_value_int64s: list[int] | None = None,
    replaced_value_float: float = 0.0,
    replaced_value_int64: int = 0,
) -> Value:
    if imputed_value_floats:
        fill, replaced = np.asarray(imputed_value_floats), replaced_value_float
    elif imputed_value_int64s:
        fill, replaced = np.asarray(imputed_value_int64s), replaced_value_int64
    else:
        raise ValueError("one of imputed_value_floats and imputed_value_int64s must be set")
    if fill.size not in (1, np.shape(X)[-1]):
        raise ValueError(f"{fill.size} imputed values for {np.shape(X)[-1]} features; expected 1 or one each")
    hit = jnp.isnan(X) if isinstance(replaced, float) and math.isnan(replaced) else X == replaced
    return jnp.where(hit, fill.astype(X.dtype), X)


# ---- feature selection and assembly --------------------------------------------------------------------------


@ml_op("ArrayFeatureExtractor")
def array_feature_extractor(X: Value, Y: Value) -> Value:
    """X[..., Y] with Y flattened; a 1-D X is one row, so the result is [1, len(Y)] (as ONNX Runtime does)."""
    xp = np if is_text(X) else jnp
    indices = static(Y, "Y") if xp is np else Y
    width = np.shape(X)[-1]
    if is_static(indices) and np.any((np.asarray(indices) < 0) | (np.asarray(indices) >= width)):
        raise IndexError(f"indices {np.asarray(indices).tolist()} out of range for a last axis of size {width}")
    picked = xp.take(X, xp.reshape(indices, -1), axis=-1)
    return picked.reshape(1, -1) if np.ndim(X) == 1 else picked


@ml_op("FeatureVectorizer")
def feature_vectorizer(*X: Value, inputdimensions: list[int] | None = None) -> Value:
    """Inputs as [N, C_i] (a 1-D input is [1, C]) cut or zero-padded to inputdimensions[i], then concatenated."""
    if inputdimensions is not None and len(inputdimensions) != len(X):
        raise ValueError(f"{len(X)} inputs but {len(inputdimensions)} inputdimensions")
    blocks = []
    for i, x in enumerate(X):
        block = jnp.reshape(x, (1, -1) if np.ndim(x) == 1 else (np.shape(x)[0], -1)).astype(np.float32)
        width = block.shape[1] if inputdimensions is None else inputdimensions[i]
        block = block[:, :width]
        blocks.append(jnp.pad(block, ((0, 0), (0, width - block.shape[1]))))
    return jnp.concatenate(blocks, axis=1)


# ---- encoders ------------------------------------------------------------------------------------------------


def _lookup(x: Value, keys: np.ndarray, values: np.ndarray, default: Any) -> Value:
    """Each element of x replaced by the value of the equal key (the last one wins; NaN keys match NaN), or by
    `default`. Numbers map on the device with a binary search; strings on either side map on the host."""
    table: dict[Any, Any] = {}
    nan_value = None
    for key, value in zip(keys.tolist(), values.tolist()):
        if isinstance(key, float) and math.isnan(key):
            nan_value = value
        else:
            table[key.decode() if isinstance(key, bytes) else key] = value
    if is_text(x) or keys.dtype == object or values.dtype == object:
        return _host_lookup(static(x, "X"), table, nan_value, default, values.dtype)
    compare = np.promote_types(np.dtype(x.dtype), keys.dtype)
    found_value = jnp.full(np.shape(x), default, dtype=values.dtype)
    if table:
        sorted_keys = np.asarray(sorted(table), dtype=compare)
        mapped = np.asarray([table[k] for k in sorted(table)], dtype=values.dtype)
        probe = jnp.asarray(x).astype(compare)
        position = jnp.minimum(jnp.searchsorted(sorted_keys, probe), len(sorted_keys) - 1)
        found_value = jnp.where(jnp.asarray(sorted_keys)[position] == probe, jnp.asarray(mapped)[position], found_value)
    if nan_value is not None:
        found_value = jnp.where(jnp.isnan(x), jnp.asarray(nan_value, values.dtype), found_value)
    return found_value


def _host_lookup(x: np.ndarray, table: dict, nan_value: Any, default: Any, dtype: np.dtype) -> np.ndarray:
    def one(element: Any) -> Any:
        if isinstance(element, float) and math.isnan(element):
            return default if nan_value is None else nan_value
        return table.get(element.decode() if isinstance(element, bytes) else element, default)

    return np.asarray([one(e) for e in x.reshape(-1).tolist()], dtype=dtype).reshape(x.shape)


def _attribute_array(name: str, ints: Any, floats: Any, strings: Any, tensor: np.ndarray | None) -> np.ndarray:
    """The one of `name`_int64s / floats / _strings / _tensor that is set, as a NumPy array of its type."""
    if tensor is not None:
        return tensor.reshape(-1)
    if strings is not None:
        return np.asarray(strings, dtype=object)
    if ints is not None:
        return np.asarray(ints, dtype=np.int64)
    if floats is not None:
        return np.asarray(floats, dtype=np.float32)
    raise ValueError(f"one of the {name}_* attributes must be set")


@ml_op("LabelEncoder", since=2)
def label_encoder(
    X: Value,
    *,
    keys_int64s: list[int] | None = None,
    keys_floats: list[float] | None = None,
    keys_strings: list[str] | None = None,
    keys_tensor: np.ndarray | None = None,
    values_int64s: list[int] | None = None,
    values_floats: list[float] | None = None,
    values_strings: list[str] | None = None,
    values_tensor: np.ndarray | None = None,
    default_int64: int = -1,
    default_float: float = -0.0,
    default_string: str = "_Unused",
    default_tensor: np.ndarray | None = None,
) -> Value:
    keys = _attribute_array("keys", keys_int64s, keys_floats, keys_strings, keys_tensor)
    values = _attribute_array("values", values_int64s, values_floats, values_strings, values_tensor)
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    if default_tensor is not None:
        default = default_tensor.reshape(-1)[0]
    else:  # the default attribute of the values' kind (also what a values_tensor without default_tensor takes)
        default = {"O": default_string, "f": default_float}.get(values.dtype.kind, default_int64)
    return _lookup(X, keys, values, default)


@ml_op("LabelEncoder", until=1)
def label_encoder_v1(
    X: Value, *, classes_strings: list[str] | None = None, default_int64: int = -1, default_string: str = "_Unused"
) -> Value:
    """Version 1: a string maps to its position in classes_strings (the last one if repeated, as ONNX Runtime
    does), an integer to the string at that position."""
    classes = np.asarray(classes_strings or [], dtype=object)
    positions = np.arange(len(classes), dtype=np.int64)
    if is_text(X):
        return _lookup(X, classes, positions, default_int64)
    return _lookup(X, positions, classes, default_string)


@ml_op("CategoryMapper")
def category_mapper(
    X: Value,
    *,
    cats_int64s: list[int] | None = None,
    cats_strings: list[str] | None = None,
    default_int64: int = -1,
    default_string: str = "_Unused",
) -> Value:
    ints = np.asarray(cats_int64s or [], dtype=np.int64)
    strings = np.asarray(cats_strings or [], dtype=object)
    if len(ints) != len(strings):
        raise ValueError(f"cats_int64s has {len(ints)} entries, cats_strings {len(strings)}; they must pair up")
    if is_text(X):
        return _lookup(X, strings, ints, default_int64)
    return _lookup(X, ints, strings, default_string)


@ml_op("OneHotEncoder")
def one_hot_encoder(
    X: Value, *, cats_int64s: list[int] | None = None, cats_strings: list[str] | None = None, zeros: int = 1
) -> Value:
    """[..., C] float32 indicators. With zeros=0 an unknown category is an error, which can only be detected
    when X is known at trace time (a traced unknown category encodes as all zeros)."""
    if is_text(X):
        if not cats_strings:
            raise ValueError("a string input needs cats_strings")
        position = {c: i for i, c in reversed(list(enumerate(cats_strings)))}
        codes = np.asarray([position.get(v, -1) for v in X.reshape(-1).tolist()]).reshape(X.shape)
        hot = codes[..., None] == np.arange(len(cats_strings))
    else:
        if not cats_int64s:
            raise ValueError("a numeric input needs cats_int64s")
        codes = jnp.asarray(X).astype(np.int64)  # float inputs are cast to integers, as the spec says
        hot = codes[..., None] == np.asarray(cats_int64s, dtype=np.int64)
    if not zeros and is_static(X) and not np.all(np.any(np.asarray(hot), axis=-1)):
        raise ValueError("an input value is not among the categories and zeros=0")
    return hot.astype(np.float32)


# ---- maps ----------------------------------------------------------------------------------------------------


def _maps(x: Any) -> tuple[list[dict], bool]:
    """(the maps, whether x was a single map) from a dict, a list of dicts, or an object array holding them."""
    if isinstance(x, np.ndarray) and x.dtype == object:
        x = x.item() if x.ndim == 0 else list(x.reshape(-1))
    if isinstance(x, dict):
        return [x], True
    if isinstance(x, (list, tuple)):
        # a fed sequence of maps holds each as a 0-d object array (feeds.checked_map)
        maps = [m.item() if isinstance(m, np.ndarray) and m.dtype == object and m.ndim == 0 else m for m in x]
        if all(isinstance(m, dict) for m in maps):
            return maps, False
    raise TypeError(f"expected a map (dict) or a sequence of maps, got {type(x).__name__}")


def _value_dtype(values: list[Any]) -> np.dtype:
    """A map's value type, from its first value: NumPy and jax scalars keep theirs; a Python float is taken as
    float (float32, ONNX's usual map value type: pass np.float64 values for double), an int as int64."""
    if not values:
        return np.dtype(np.float32)
    first = values[0]
    if isinstance(first, (str, bytes)):
        return np.dtype(object)
    if hasattr(first, "dtype"):
        return np.dtype(first.dtype)
    return np.dtype(np.int64 if isinstance(first, int) else np.float32)


def _stack(rows: list[list[Any]], dtype: np.dtype) -> Value:
    """A [N, C] tensor of map values: NumPy when all are known, jnp when some are traced (they came from a
    ZipMap of traced scores)."""
    if dtype == object:
        if not all(isinstance(v, (str, bytes)) for r in rows for v in r):
            raise StaticValueRequired("X")  # numbers written as text are computed on the host
        return np.asarray(rows, dtype=object).reshape(len(rows), -1)
    if all(is_static(v) for r in rows for v in r):
        return np.asarray(rows, dtype=dtype).reshape(len(rows), -1)
    return jnp.array(rows, dtype=dtype).reshape(len(rows), -1)


@ml_op("ZipMap")
def zip_map(
    X: Value, *, classlabels_int64s: list[int] | None = None, classlabels_strings: list[str] | None = None
) -> list[dict]:
    if (classlabels_int64s is None) == (classlabels_strings is None):
        raise ValueError("exactly one of classlabels_int64s and classlabels_strings must be set")
    keys = [int(k) for k in classlabels_int64s] if classlabels_int64s is not None else list(classlabels_strings)
    rows = as_rows(X)
    if rows.ndim != 2 or rows.shape[1] != len(keys):
        raise ValueError(f"input of shape {np.shape(X)} does not have one column per key ({len(keys)})")
    return [dict(zip(keys, row)) for row in rows]


@ml_op("DictVectorizer")
def dict_vectorizer(
    X: Any, *, int64_vocabulary: list[int] | None = None, string_vocabulary: list[str] | None = None
) -> Value:
    """Map values placed at their key's position in the vocabulary, zero elsewhere: [1, V] for one map (as ONNX
    Runtime does), [N, V] for a sequence of N maps. Keys outside the vocabulary are ignored."""
    if (int64_vocabulary is None) == (string_vocabulary is None):
        raise ValueError("exactly one of int64_vocabulary and string_vocabulary must be set")
    vocabulary = list(int64_vocabulary if int64_vocabulary is not None else string_vocabulary)
    maps, _ = _maps(X)
    dtype = _value_dtype([v for m in maps for v in m.values()])
    zero = "" if dtype == object else 0
    return _stack([[m.get(k, zero) for k in vocabulary] for m in maps], dtype)


_CASTS = {"TO_FLOAT": np.dtype(np.float32), "TO_INT64": np.dtype(np.int64), "TO_STRING": np.dtype(object)}


@ml_op("CastMap")
def cast_map(X: Any, *, cast_to: str = "TO_FLOAT", map_form: str = "DENSE", max_map: int = 1) -> Value:
    """A map's values in ascending key order, as [1, n]: all of them (DENSE), or at positions 0..max_map-1 with
    the missing ones padded (SPARSE: 0, or "0.f" for strings, which is ONNX Runtime's pad)."""
    if cast_to not in _CASTS:
        raise ValueError(f"unknown cast_to {cast_to!r}; expected one of {list(_CASTS)}")
    maps, single = _maps(X)
    if not single:
        raise TypeError("CastMap takes one map, not a sequence of maps")
    mapping = maps[0]
    dtype = _CASTS[cast_to]
    if map_form == "DENSE":
        values = [mapping[k] for k in sorted(mapping)]
    elif map_form == "SPARSE":
        if any(k < 0 for k in mapping):
            raise ValueError("SPARSE CastMap keys must not be negative")
        pad = "0.f" if dtype == object else 0
        values = [mapping.get(k, pad) for k in range(max_map)]
    else:
        raise ValueError(f"unknown map_form {map_form!r}; expected 'DENSE' or 'SPARSE'")
    return _stack([[_cast_scalar(v, dtype) for v in values]], dtype)


def _cast_scalar(value: Any, dtype: np.dtype) -> Any:
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        return text if dtype == object else dtype.type(float(text) if dtype.kind == "f" else int(text))
    if dtype == object:
        if not is_static(value):
            raise StaticValueRequired("X")
        return f"{float(value):f}"  # C++'s std::to_string, which is how ONNX Runtime writes floats
    if is_static(value):
        return np.asarray(value).astype(dtype)
    return jnp.asarray(value).astype(dtype)  # TO_INT64 truncates toward zero, as a C++ cast does
