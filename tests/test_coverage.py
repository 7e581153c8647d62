"""Every since_version of every operator in onnx's schema history is either lowered here, runs through its
schema's function body, or is on the explained exclusion list (which only shrinks)."""

from onnxtrain.coverage import DIRECT, MISSING, coverage

# (domain, op, since_version) -> why it is not supported
EXCLUDED: dict[tuple[str, str, int], str] = {}


def test_every_schema_version_is_covered_or_explained():
    missing = {key for key, how in coverage().items() if how == MISSING}
    assert missing <= set(EXCLUDED), f"neither implemented nor excluded: {sorted(missing - set(EXCLUDED))}"
    assert not set(EXCLUDED) - missing, f"excluded but now covered, remove: {sorted(set(EXCLUDED) - missing)}"


def test_the_three_domains_are_lowered_directly():
    table = coverage()
    for domain in ("", "ai.onnx.ml", "ai.onnx.preview.training"):
        versions = [how for (d, _, _), how in table.items() if d == domain]
        assert versions and all(how == DIRECT for how in versions), domain


def test_docs_table_is_current():
    from pathlib import Path

    from onnxtrain.coverage import markdown

    docs = Path(__file__).parent.parent / "docs" / "ops.md"
    assert docs.read_text() == markdown(), "regenerate: python -m onnxtrain.coverage > docs/ops.md"
