"""Tool-call formats: parsers by name (`.registry`), the streaming split (`.streaming`), the grammar that
makes calls well-formed (`.constraint`)."""
