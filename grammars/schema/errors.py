"""The one error the schema pipeline raises: a keyword, where it is, and why."""

from __future__ import annotations


class SchemaRefusal(ValueError):
    """A schema construct that cannot be enforced exactly (the API answers 400 when strict).

    `keyword` is the JSON Schema keyword, `pointer` the JSON pointer (`#/...`) of the
    schema object that holds it.
    """

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        self.keyword, self.pointer, self.why = keyword, pointer, why
        super().__init__(f"{self.where}: {why}")

    @property
    def where(self) -> str:
        """The keyword's own pointer."""
        return f"{self.pointer}/{self.keyword}" if self.keyword else self.pointer
