"""JSON schema -> grammar, with xgrammar 0.2.9's bounded-string rule repaired.

For a string with ``minLength`` / ``maxLength`` xgrammar emits ``X_characters ::= [^"\\\r\n]``
repeated ``{min, max}``: no escape branch and raw control characters U+0000-U+001F admitted, so the
output fails a strict JSON parser. We take xgrammar's EBNF for the schema and replace each such rule
with one JSON unit: a non-control, non-quote, non-backslash character, or an escape sequence. An
escape decodes to exactly one character, so ``{min, max}`` still counts decoded characters; UTF-16
surrogate escapes (``\\uD800``-``\\uDFFF``) are left out, because a pair decodes to one character, and so
are raw surrogate code points, which are not UTF-8.
"""

from __future__ import annotations

import re

import xgrammar as xgr

# The rule body xgrammar 0.2.9 prints for one character of a length-bounded string.
_BOUNDED_CHAR_RULE = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# The same class inline (not inside xgrammar's unbounded basic_string_sub, whose class starts [^\0-\x1f).
_INLINE_CHAR = re.compile(r'\[\^\\"\\\\\\r\\n\]')
ESCAPE_RULE = "radixrt_json_escape"
# Surrogates (U+D800-U+DFFF) are excluded too: xgrammar's character classes match them, encoded as three
# bytes that are not UTF-8 (ED A0 80 ...), so one "character" decodes to three U+FFFD and breaks maxLength.
_JSON_UNIT = r'(([^\0-\x1f\"\\\uD800-\uDFFF]) | ("\\" ' + ESCAPE_RULE + "))"
_HEX = "[0-9a-fA-F]"
_ESCAPE_DEF = (
    f'{ESCAPE_RULE} ::= [\\"\\\\/bfnrt] | "u" [0-9a-cA-CeEfF] {_HEX} {_HEX} {_HEX}'
    f' | "u" [dD] [0-7] {_HEX} {_HEX}'
)


def repair_bounded_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printout of a JSON schema grammar) with every bounded-string character
    made JSON-correct; unchanged when it has none. Besides the rule form above, a string of at most one
    character prints the class inline (``root_1 ::= ("" | ([^\"\\\r\n]))``, or ``"\"" [^\"\\\r\n] "\""`` for
    exactly one), so the class is also replaced where it stands alone."""
    fixed, count = _BOUNDED_CHAR_RULE.subn(lambda m: f"{m.group(1)} ::= {_JSON_UNIT}", ebnf)
    fixed, inline = _INLINE_CHAR.subn(lambda _: _JSON_UNIT, fixed)
    if count + inline == 0:
        return ebnf
    return f"{fixed.rstrip()}\n{_ESCAPE_DEF}\n"


def json_schema_grammar(schema: str, whitespace: bool) -> xgr.Grammar:
    """The grammar for ``schema`` (JSON text): compact separators, or up to two whitespace characters where JSON
    allows them (``whitespace``)."""
    if whitespace:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=2)
    else:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    fixed = repair_bounded_strings(text)
    return grammar if fixed is text else xgr.Grammar.from_ebnf(fixed)
