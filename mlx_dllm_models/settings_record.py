"""What the resolved settings do beyond holding their values: the methods of
settings_fields.ResolvedSettings, the frozen dataclass generated from the settings table.

The object has a field for every row of the table, so a misspelt name fails where it is written
(a type checker, the test that scans the package's reads) instead of deep in a run. One family has
only some of the rows: `present` names the settings the family has, in resolution order (the shared
rows, then the family's). A setting the family does not have holds None and is not present: a read
of it answers None, `has` tells the two apart, and `as_dict` (the one serialisation: the server's
grouping of requests, `mlx_dllm settings`) lists the present settings only. The resolver refuses a
setting a family does not have before the object is built (naming the families it belongs to).
Updates go through dataclasses.replace; there is no item access, so a name held as data is read
with getattr.
"""

from typing import Any, Dict, Mapping, Tuple, Type, TypeVar

# Names of the record itself: a setting cannot take them (settings_index checks when generating).
RECORD_NAMES = ("present", "has", "as_dict", "from_dict")

R = TypeVar("R", bound="SettingsRecord")


class SettingsRecord:
    present: Tuple[str, ...]

    def has(self, name: str) -> bool:
        """Whether the family has setting `name` (a field outside `present` holds None)."""
        return name in self.present

    def as_dict(self) -> Dict[str, Any]:
        """The present settings by name, in resolution order."""
        return {name: getattr(self, name) for name in self.present}

    @classmethod
    def from_dict(cls: Type[R], values: Mapping[str, Any]) -> R:
        """The object holding `values` (a name that is no setting is refused as a TypeError)."""
        return cls(present=tuple(values), **values)  # type: ignore[call-arg]
