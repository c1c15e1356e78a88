"""The docs' generated reference pages (hack/docs_reference.py): in step with their sources, and
complete: every Helm value and every CRD field has a row, a description the reader can use, and
text that renders as written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_reference",
                                               ROOT / "hack" / "docs_reference.py")
docs_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_reference)


def test_the_committed_pages_are_what_the_sources_generate():
    assert docs_reference.main(["--check"]) == 0


def test_every_helm_value_is_documented_by_itself_or_its_parent():
    text = docs_reference.VALUES.read_text()
    assert all(comment for _, comment in docs_reference._value_comments(text))
    assert docs_reference.undocumented_values(text) == []


def test_a_values_key_without_a_comment_fails_the_check_naming_it(tmp_path, monkeypatch, capsys):
    values = tmp_path / "values.yaml"
    values.write_text(docs_reference.VALUES.read_text()
                      + "\n# -- Documented.\nnewKey: 1\nextra:\n  quiet: true\n")
    monkeypatch.setattr(docs_reference, "VALUES", values)
    monkeypatch.setattr(docs_reference, "ROOT", tmp_path)
    monkeypatch.setattr(docs_reference, "OUT", tmp_path / "reference")
    assert docs_reference.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("values.yaml: no `# --` comment on extra.quiet;")
    assert "newKey" not in err
    assert docs_reference.main([]) == 1  # `make manifests` refuses to write it too


def test_every_spec_field_of_the_crd_has_a_row():
    page = docs_reference.crd_reference()
    crd = yaml.safe_load(docs_reference.CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for field in spec["properties"]:
        assert f"| `{field}` |" in page
    assert "## `spec.runPolicy`" in page and "## `status.progress`" in page


def test_cells_keep_code_spans_as_written_and_escape_tags_and_pipes_elsewhere():
    assert docs_reference.cell("the Service `<release>-metrics`, <b>\n a|b") == (
        "the Service `<release>-metrics`, &lt;b&gt; a\\|b")
