"""String ops: StringNormalizer, StringConcat, StringSplit, RegexFullMatch, and TfIdfVectorizer.

XLA has no strings, so string tensors are always static NumPy object arrays and these ops run on the host in
NumPy and Python's `str`. TfIdfVectorizer also takes integer tokens, which may be traced: its counting is
written once in jax.numpy over integer ids, and string tokens are first mapped to ids on the host.

ImageDecoder is not implemented: no image codec is installed alongside onnxtrain.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from ..registry import op, versions
from ..values import Value, is_text, static

Array = Any  # a jax array or a NumPy array (static value)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _strings(x: Value, what: str) -> np.ndarray:
    values = static(x, what)
    if values.dtype.kind not in "OUS":
        raise TypeError(f"input {what!r} must be a string tensor, got {values.dtype}")
    return values


def _map(fn: Callable, *arrays: np.ndarray, otype: Any = object) -> np.ndarray:
    """`fn` over the elements of broadcast string arrays, as `str`."""
    result = np.vectorize(lambda *items: fn(*map(_text, items)), otypes=[otype])(*arrays)
    return np.asarray(result, dtype=otype)


# ---- StringNormalizer ----------------------------------------------------------------------------------------

CASE_CHANGES: dict[str, Callable[[str], str]] = {"NONE": lambda s: s, "LOWER": str.lower, "UPPER": str.upper}


@op("StringNormalizer", *versions("StringNormalizer"))
def string_normalizer(
    x: Value,
    *,
    case_change_action: str = "NONE",
    is_case_sensitive: int = 0,
    locale: str = "",
    stopwords: list[str] | None = None,
) -> np.ndarray:
    """Drops the elements equal to a stop word, then changes case.

    Case follows Unicode's rules (Python's str.lower/upper), which do not depend on `locale`. Only [C] and
    [1, C] inputs are defined; when every element is dropped the result is one empty string, [1] or [1, 1].
    """
    values = _strings(x, "X")
    if values.ndim not in (1, 2) or (values.ndim == 2 and values.shape[0] != 1):
        raise ValueError(f"X must have shape [C] or [1, C], got {values.shape}")
    if case_change_action not in CASE_CHANGES:
        raise ValueError(f"unknown case_change_action {case_change_action!r}; expected one of {sorted(CASE_CHANGES)}")
    key = (lambda s: s) if is_case_sensitive else str.casefold
    stops = {key(w) for w in stopwords or []}
    kept = [CASE_CHANGES[case_change_action](s) for s in map(_text, values.reshape(-1)) if key(s) not in stops]
    result = np.array(kept or [""], dtype=object)
    return result.reshape(values.shape[:-1] + (-1,))


# ---- StringConcat, StringSplit, RegexFullMatch ---------------------------------------------------------------


@op("StringConcat", *versions("StringConcat"))
def string_concat(x: Value, y: Value) -> np.ndarray:
    return _map(lambda a, b: a + b, _strings(x, "X"), _strings(y, "Y"))


@op("StringSplit", *versions("StringSplit"))
def string_split(x: Value, *, delimiter: str = "", maxsplit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pieces padded with empty strings to the longest split. No delimiter (or "") splits on runs of
    whitespace and drops leading and trailing whitespace, as Python's str.split(None) does."""
    values = _strings(x, "X")
    limit = -1 if maxsplit is None else maxsplit
    pieces = [_text(s).split(delimiter or None, limit) for s in values.reshape(-1)]
    width = max(map(len, pieces), default=0)
    padded = np.array([p + [""] * (width - len(p)) for p in pieces], dtype=object).reshape(values.shape + (width,))
    counts = np.array([len(p) for p in pieces], dtype=np.int64).reshape(values.shape)
    return padded, counts


# RE2's POSIX classes, which Python's `re` lacks, as the bracket contents they stand for.
POSIX_CLASSES: dict[str, str] = {
    "alnum": "0-9A-Za-z",
    "alpha": "A-Za-z",
    "ascii": "\\x00-\\x7f",
    "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9",
    "graph": "!-~",
    "lower": "a-z",
    "print": " -~",
    "punct": "!-/:-@\\[-`{-~",
    "space": "\\t\\n\\v\\f\\r ",
    "upper": "A-Z",
    "word": "0-9A-Za-z_",
    "xdigit": "0-9A-Fa-f",
}


def compile_re2(pattern: str) -> re.Pattern:
    """An RE2 pattern as a Python one: the syntax RE2 accepts is, POSIX classes aside, a subset of Python's."""
    translated = re.sub(r"\[:(\^?)(\w+):\]", lambda m: _posix_class(m.group(2), bool(m.group(1))), pattern)
    try:
        return re.compile(translated)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None


def _posix_class(name: str, negated: bool) -> str:
    if name not in POSIX_CLASSES:
        raise ValueError(f"unknown POSIX character class [:{name}:]")
    if negated:
        raise ValueError(f"negated POSIX character class [:^{name}:] is not supported")
    return POSIX_CLASSES[name]


@op("RegexFullMatch", *versions("RegexFullMatch"))
def regex_full_match(x: Value, *, pattern: str) -> np.ndarray:
    regex = compile_re2(pattern)
    return _map(lambda s: regex.fullmatch(s) is not None, _strings(x, "X"), otype=bool)


# ---- TfIdfVectorizer -----------------------------------------------------------------------------------------

WEIGHTINGS = ("TF", "IDF", "TFIDF")


def _pool_ngrams(pool: list, ngram_counts: list[int], n: int) -> list:
    """The n-grams of length n in the pool: ngram_counts[n - 1] is where they start, as in CSR."""
    if n > len(ngram_counts):
        return []
    start = ngram_counts[n - 1]
    end = ngram_counts[n] if n < len(ngram_counts) else len(pool)
    return [pool[i : i + n] for i in range(start, end - n + 1, n)]


def _token_ids(x: Value, pool: list) -> tuple[Array, list[int]]:
    """Tokens and pool entries as integer ids: strings are numbered on the host (-1: not in the pool)."""
    if is_text(x):
        ids = {_text(s): i for i, s in reversed(list(enumerate(pool)))}
        tokens = np.array([ids.get(_text(s), -1) for s in x.reshape(-1)], dtype=np.int64).reshape(x.shape)
        return tokens, [ids[_text(s)] for s in pool]
    return jnp.asarray(x).astype(np.int64), [int(v) for v in pool]


@op("TfIdfVectorizer", *versions("TfIdfVectorizer"))
def tf_idf_vectorizer(
    x: Value,
    *,
    max_gram_length: int,
    max_skip_count: int,
    min_gram_length: int,
    mode: str,
    ngram_counts: list[int],
    ngram_indexes: list[int],
    pool_int64s: list[int] | None = None,
    pool_strings: list[str] | None = None,
    weights: list[float] | None = None,
) -> Array:
    """Counts, per row, every n-gram of the pool (min_gram_length <= n <= max_gram_length) found with its items
    1 to max_skip_count + 1 positions apart. A 1-gram has no gaps, so it is counted once, not once per gap."""
    if mode not in WEIGHTINGS:
        raise ValueError(f"unknown mode {mode!r}; expected one of {WEIGHTINGS}")
    if (pool_int64s is None) == (pool_strings is None):
        raise ValueError("exactly one of pool_int64s and pool_strings must be given")
    if np.ndim(x) not in (1, 2):
        raise ValueError(f"X must have shape [C] or [N, C], got {np.shape(x)}")
    tokens, pool = _token_ids(x, pool_int64s if pool_strings is None else pool_strings)
    rows = jnp.reshape(tokens, (-1, np.shape(x)[-1]))
    width = np.shape(x)[-1]
    size = max(ngram_indexes) + 1
    counts = jnp.zeros((rows.shape[0], size), np.float32)
    entry = 0  # position in the pool (and in ngram_indexes) of the first n-gram of the current length
    for n in range(1, len(ngram_counts) + 1):
        grams = _pool_ngrams(pool, ngram_counts, n)
        if grams and min_gram_length <= n <= max_gram_length:
            columns = np.asarray(ngram_indexes[entry : entry + len(grams)])
            for gap in range(1, (max_skip_count if n > 1 else 0) + 2):
                span = (n - 1) * gap
                if span >= width:
                    break
                # windows[r, s, k] = rows[r, s + k * gap]: every n-gram with this gap, one per start s
                starts = np.arange(width - span)[:, None] + gap * np.arange(n)[None, :]
                found = jnp.all(rows[:, starts][:, :, None, :] == np.asarray(grams), axis=-1)
                counts = counts.at[:, columns].add(jnp.sum(found, axis=1).astype(np.float32))
        entry += len(grams)
    # Weights go by output column, as ONNX Runtime and ONNX's reference apply them.
    if weights and len(weights) < size:
        raise ValueError(f"weights has {len(weights)} values, the output has {size} columns")
    scale = jnp.asarray(weights[:size] if weights else np.ones(size), np.float32)
    if mode == "IDF":
        counts = (counts > 0) * scale
    elif mode == "TFIDF":
        counts = counts * scale
    return counts.reshape(np.shape(x)[:-1] + (size,)).astype(np.float32)
