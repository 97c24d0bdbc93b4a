"""Twenty JSON schemas of varied shape for the structured-output tests: nested objects, arrays
with min/max items, enums, required and optional fields, bounded numbers, strings with patterns.
Strings are short (maxLength, patterns, enums) so a small model's answers end within a few
dozen tokens."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

S = {"type": "string", "maxLength": 8}  # a short free string

SCHEMAS: List[Tuple[str, Dict[str, Any]]] = [
    ("person", {"type": "object", "properties": {
        "name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("enum_color", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("bool_flag", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"]}),
    ("nested_address", {"type": "object", "properties": {
        "city": S, "address": {"type": "object", "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "street": S}, "required": ["zip", "street"]}},
        "required": ["city", "address"]}),
    ("int_array", {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 2, "maxItems": 4}}, "required": ["scores"]}),
    ("tags", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}}, "required": ["tags"]}),
    ("top_array", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5},
                   "minItems": 3, "maxItems": 3}),
    ("pattern_code", {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]}),
    ("optional_fields", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "note": S}, "required": ["id"], "additionalProperties": False}),
    ("bounded_number", {"type": "object", "properties": {
        "temp": {"type": "number", "minimum": -10, "maximum": 40}}, "required": ["temp"]}),
    ("const_version", {"type": "object", "properties": {
        "version": {"const": "1.0"}, "name": S}, "required": ["version", "name"]}),
    ("array_of_objects", {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}}}, "required": ["items"]}),
    ("mixed_enum", {"type": "object", "properties": {
        "level": {"enum": [1, 2, 3, "max"]}}, "required": ["level"]}),
    ("nullable", {"type": "object", "properties": {
        "value": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}},
        "required": ["value"]}),
    ("deep_nesting", {"type": "object", "properties": {
        "a": {"type": "object", "properties": {
            "b": {"type": "object", "properties": {
                "c": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["c"]}},
            "required": ["b"]}}, "required": ["a"]}),
    ("string_lengths", {"type": "object", "properties": {
        "word": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["word"]}),
    ("anyof", {"type": "object", "properties": {
        "x": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}},
        "required": ["x"]}),
    ("ref_defs", {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"]}),
    ("date_pattern", {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"]}),
    ("weather", {"type": "object", "properties": {
        "city": S, "unit": {"enum": ["C", "F"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": -20, "maximum": 45},
                 "minItems": 1, "maxItems": 3}}, "required": ["city", "unit", "days"]}),
]
