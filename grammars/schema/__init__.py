"""JSON Schema -> the schema xgrammar enforces exactly, or a refusal naming the keyword.

```
schema --refs.resolve_refs--> one tree, recursive refs in root $defs
       --normalize.Normalizer--> normal form (merge.py): allOf/oneOf/not/if merged in
       --finish.finish--> xgrammar's terms (full-match patterns, exclusions as ranges, ...)
       --enforce.check--> only keywords xgrammar enforces; SchemaRefusal otherwise
```
"""

from __future__ import annotations

from typing import Any

from grammars.schema.enforce import check
from grammars.schema.errors import SchemaRefusal
from grammars.schema.finish import finish
from grammars.schema.normalize import Normalizer, Policy
from grammars.schema.refs import resolve_refs

__all__ = ["SchemaRefusal", "normalize_schema"]


def normalize_schema(schema: dict[str, Any], strict: bool) -> tuple[Any, list[str]]:
    """The schema to compile and the keywords dropped (only when not strict: else refused)."""
    policy = Policy(strict)
    resolved = resolve_refs(schema)
    raw_defs = resolved.pop("$defs", {})
    norm = Normalizer(raw_defs, policy)
    nf = norm.normalize(resolved, "#")
    defs = {
        name: check(finish(body, norm, f"#/$defs/{name}"), policy, f"#/$defs/{name}")
        for name, body in norm.defs.items()
    }
    out = check(finish(nf, norm, "#"), policy, "#")
    if nf is False:
        return out, policy.dropped
    if defs:
        out = {"allOf": [out], "$defs": defs} if "$ref" in out else {**out, "$defs": defs}
    return out, policy.dropped
