"""kubectl's JSONPath templates (`-o jsonpath='{.status.phase}'`, `wait --for=jsonpath=...`) read
with jsonpath-ng: each `{EXPR}` of the template is a JSONPath expression (`$` added in front),
the text between them is printed as it is, and so is a string literal (`{"\\n"}`, `{"\\t"}`); a
field's name may escape a dot (`{.metadata.annotations.kubectl\\.kubernetes\\.io/revision}`), as
in kubectl. `{range}`/`{end}` loops are not supported."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from jsonpath_ng.ext import parse

# One `{...}` of a template: a string literal in it may hold braces (`{"}"}`).
_EXPRESSION = re.compile(r"""\{((?:"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^{}"'])*)\}""")
_LITERAL = re.compile(r"""\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s*""")
# A field name jsonpath-ng reads unquoted; any other is quoted for it.
_PLAIN_FIELD = re.compile(r"[A-Za-z0-9_@`*-]*")
_HINT = "write it as kubectl does, e.g. jsonpath='{.status.phase}'"


class TemplateError(ValueError):
    """A template that cannot be read; the message says which part and how to write it."""


@dataclass(frozen=True)
class Template:
    """A parsed template: literal text and compiled expressions, alternating."""

    source: str
    parts: tuple[Any, ...]

    def values(self, data: Any) -> list[Any]:
        """Every value the template's expressions find in `data`, in order."""
        return [match.value for part in self.parts if not isinstance(part, str)
                for match in part.find(data)]

    def render(self, data: Any) -> str:
        """The template printed for `data`: several matches of one expression joined by a
        space, as kubectl does; maps and lists as JSON."""
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            else:
                out.append(" ".join(_text(match.value) for match in part.find(data)))
        return "".join(out)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (dict, list)) or value is None else str(value)


def _literal(quoted: str) -> str:
    """kubectl's string literal (`{"\\n"}`, `{'\\t'}`, `{"text"}`) as the text it prints."""
    try:
        return str(ast.literal_eval(quoted))
    except (SyntaxError, ValueError) as error:
        raise TemplateError(f"jsonpath: cannot read the string {{{quoted}}} ({error}); {_HINT}"
                            ) from None


def _quote_fields(text: str) -> str:
    """kubectl's field names as jsonpath-ng reads them: a name with an escaped character
    (`kubectl\\.kubernetes\\.io/name`, a dot in an annotation's key) or one jsonpath-ng
    does not read bare is quoted, kubectl's backslashes dropped. Filters in [] are left."""
    out, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if index < start:
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        out.append(char)
        if char != "." or depth:
            continue
        end = index + 1
        while end < len(text) and text[end] not in ".[]":
            end += 2 if text[end] == "\\" else 1
        name, start = text[index + 1:end], end
        if _PLAIN_FIELD.fullmatch(name):
            out.append(name)
        else:
            out.append('"' + name.replace("\\", "").replace('"', '\\"') + '"')
    return "".join(out)


def _compile(expression: str) -> Any:
    text = expression.strip()
    if text.startswith(("range", "end")):
        raise TemplateError(f"jsonpath: {{{text}}} loops are not supported; {_HINT}, and print "
                            "a list with [*] ({.items[*].metadata.name})")
    if text.startswith("$"):
        text = text[1:]
    path = "$" + _quote_fields(text if text.startswith(("[", ".")) or not text else "." + text)
    try:
        return parse(path)
    except Exception as error:  # jsonpath-ng raises its own and plain ones
        raise TemplateError(f"jsonpath: cannot read {{{expression}}} ({error}); {_HINT}"
                            ) from None


def compile_template(source: str) -> Template:
    """`{.status.phase}` or `phase={.status.phase}`; a bare `.status.phase` is one expression.
    Raises TemplateError naming the part it cannot read."""
    if not source.strip():
        raise TemplateError(f"jsonpath: the template is empty; {_HINT}")
    if "{" not in source:
        return Template(source, (_compile(source),))
    parts: list[Any] = []
    position = 0
    for match in _EXPRESSION.finditer(source):
        if match.start() > position:
            parts.append(source[position:match.start()])
        literal = _LITERAL.fullmatch(match.group(1))
        parts.append(_literal(literal.group(1)) if literal else _compile(match.group(1)))
        position = match.end()
    rest = source[position:]
    if "{" in rest or "}" in rest:
        raise TemplateError(f"jsonpath: unbalanced braces in {source!r}; {_HINT}")
    if rest:
        parts.append(rest)
    return Template(source, tuple(parts))
