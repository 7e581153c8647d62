"""String ops: what conformance leaves out (Unicode, shapes, POSIX classes, traced integer tokens for
TfIdfVectorizer, weighting modes, errors). References are onnx's ReferenceEvaluator, or Python written here."""

import numpy as np
import pytest

import onnxtrain
from nodes import node_model, run_both
from onnxtrain.errors import NodeError
from nodes import run_with_engine as run


def strings(*values):
    return np.array(values, dtype=object)


# ---- StringNormalizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sensitive", "action", "expected"),
    [(0, "UPPER", ["ÉTÉ", "NUIT"]), (1, "LOWER", ["été", "jour", "nuit"]), (0, "NONE", ["été", "Nuit"])],
)
def test_string_normalizer_unicode_and_case_sensitivity(sensitive, action, expected):
    x = strings("été", "Jour", "Nuit")
    attrs = {"stopwords": ["jour"], "is_case_sensitive": sensitive, "case_change_action": action}
    (got,), _ = run(node_model("StringNormalizer", {"x": x}, **attrs), {"x": x})
    assert got.dtype == object and got.tolist() == expected


@pytest.mark.parametrize("shape", [(3,), (1, 3)])
def test_string_normalizer_dropping_everything_leaves_one_empty_string(shape):
    x = strings("a", "B", "a").reshape(shape)
    (got,), _ = run(node_model("StringNormalizer", {"x": x}, stopwords=["A", "b"]), {"x": x})
    assert got.shape == shape[:-1] + (1,) and got.reshape(-1).tolist() == [""]


def test_string_normalizer_matches_reference_on_ascii():
    x = strings("monday", "Tuesday", "MONDAY", "wednesday").reshape(1, 4)
    attrs = {"stopwords": ["monday"], "case_change_action": "LOWER"}
    ours, theirs = run_both(node_model("StringNormalizer", {"x": x}, **attrs), {"x": x})
    assert ours[0].tolist() == theirs[0].tolist()


def test_string_normalizer_errors():
    x = strings("a", "b", "c", "d").reshape(2, 2)
    with pytest.raises(NodeError, match=r"X must have shape \[C\] or \[1, C\], got \(2, 2\)"):
        run(node_model("StringNormalizer", {"x": x}), {"x": x})
    x = strings("a")
    with pytest.raises(NodeError, match="unknown case_change_action 'TITLE'"):
        run(node_model("StringNormalizer", {"x": x}, case_change_action="TITLE"), {"x": x})


# ---- StringConcat --------------------------------------------------------------------------------------------


def test_string_concat_broadcasts_unicode():
    inputs = {"x": strings("α", "", "日本").reshape(3, 1), "y": strings("β", "語 ")}
    ours, theirs = run_both(node_model("StringConcat", inputs), inputs)
    assert ours[0].dtype == object and ours[0].shape == (3, 2)
    assert ours[0].tolist() == theirs[0].tolist()


@pytest.mark.filterwarnings("ignore:.*compiled in as constants")  # the float feed is compiled in, then rejected
def test_string_concat_rejects_numbers():
    inputs = {"x": strings("a"), "y": np.array([1.0], np.float32)}
    with pytest.raises(NodeError, match="input 'Y' must be a string tensor"):
        run(node_model("StringConcat", inputs), inputs)


# ---- StringSplit ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs", [{}, {"delimiter": ""}, {"delimiter": ";"}, {"delimiter": ";;", "maxsplit": 1}, {"maxsplit": 0}]
)
def test_string_split_matches_reference(attrs):
    x = strings("  a b\tc  ", "x;;y;z", "", ";;;").reshape(2, 2)
    ours, theirs = run_both(node_model("StringSplit", {"x": x}, n_outputs=2, **attrs), {"x": x})
    assert ours[0].shape == theirs[0].shape and ours[0].tolist() == theirs[0].tolist()
    assert ours[1].dtype == np.int64
    np.testing.assert_array_equal(ours[1], theirs[1])


def test_string_split_empty_input():
    x = np.zeros((0, 3), dtype=object)
    (pieces, counts), _ = run(node_model("StringSplit", {"x": x}, n_outputs=2, delimiter=","), {"x": x})
    assert pieces.shape == (0, 3, 0) and counts.shape == (0, 3) and counts.dtype == np.int64


# ---- RegexFullMatch ------------------------------------------------------------------------------------------


def test_regex_full_match_2d_and_reference():
    x = strings("ab12", "AB", "12", "").reshape(2, 2)
    ours, theirs = run_both(node_model("RegexFullMatch", {"x": x}, pattern=r"[a-z]*\d+"), {"x": x})
    assert ours[0].dtype == np.bool_
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_regex_full_match_posix_classes():
    x = strings("abc123", "ABC", "a_b", " \t")
    (got,), _ = run(node_model("RegexFullMatch", {"x": x}, pattern="[[:alpha:]]+[[:digit:]]*|[[:space:]]+"), {"x": x})
    np.testing.assert_array_equal(got, [True, True, False, True])


def test_regex_full_match_invalid_pattern():
    x = strings("a")
    with pytest.raises(NodeError, match=r"invalid regular expression '\(a'"):
        run(node_model("RegexFullMatch", {"x": x}, pattern="(a"), {"x": x})


# ---- TfIdfVectorizer -----------------------------------------------------------------------------------------

POOL = [2, 3, 5, 4, 5, 6, 7, 8, 6, 7]  # 1-grams 2 3 5 4; 2-grams (5, 6) (7, 8) (6, 7)
GRAMS = {"ngram_counts": [0, 4], "ngram_indexes": [0, 1, 2, 3, 4, 5, 6]}


def tf_idf_attrs(**changes):
    attrs = {"min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 2, "mode": "TF", "pool_int64s": POOL}
    return {**attrs, **GRAMS, **changes}


def test_tf_idf_traced_tokens_compile_once():
    x = np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], np.int64)
    model = node_model("TfIdfVectorizer", {"x": x}, **tf_idf_attrs())
    engine = onnxtrain.load(model, check=False)
    for tokens in (x, x[::-1], np.array([[5, 6, 5, 6, 6, 7], [7, 7, 8, 8, 2, 4]])):
        got = np.asarray(engine.infer({"x": tokens})["out0"])
        _, (want,) = run_both(model, {"x": tokens})
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    assert engine.trace_count == 1


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("weights", [None, [0.5, 2.0, 1.0, 3.0, 0.25, 4.0, 1.5]])
def test_tf_idf_modes_int32_rows(mode, weights):
    x = np.array([[2, 3, 5, 6, 7, 8, 5, 6], [4, 4, 4, 6, 5, 7, 6, 2]], np.int32)
    attrs = tf_idf_attrs(max_skip_count=1)
    _, (counts,) = run_both(node_model("TfIdfVectorizer", {"x": x}, **attrs), {"x": x})  # TF from the reference
    scale = np.ones(7) if weights is None else np.array(weights)
    want = {"TF": counts, "IDF": (counts > 0) * scale, "TFIDF": counts * scale}[mode]
    if weights is not None:
        attrs["weights"] = weights
    (got,), _ = run(node_model("TfIdfVectorizer", {"x": x}, **{**attrs, "mode": mode}), {"x": x})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(("low", "high"), [(2, 2), (1, 1)])
def test_tf_idf_strings_one_row_and_gram_range(low, high):
    x = strings("a", "b", "x", "c", "a", "b", "c")
    attrs = {
        "min_gram_length": low, "max_gram_length": high, "max_skip_count": 1, "mode": "TF",
        "pool_strings": ["a", "c", "a", "b", "b", "c"], "ngram_counts": [0, 2], "ngram_indexes": [3, 2, 0, 1],
    }  # fmt: skip
    ours, theirs = run_both(node_model("TfIdfVectorizer", {"x": x}, **attrs), {"x": x})
    assert ours[0].shape == (4,)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_tf_idf_errors():
    x = np.array([1, 2], np.int64)
    with pytest.raises(NodeError, match="unknown mode 'BM25'"):
        run(node_model("TfIdfVectorizer", {"x": x}, **tf_idf_attrs(mode="BM25")), {"x": x})
    with pytest.raises(NodeError, match="weights has 2 values, the output has 7 columns"):
        run(node_model("TfIdfVectorizer", {"x": x}, **tf_idf_attrs(mode="IDF", weights=[1.0, 2.0])), {"x": x})
