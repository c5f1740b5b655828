"""The rules every dialect's parameters share, each defined once: what true and false are spelled
as, and what a key given more than once means (docs/protocol.md, "Query parameters").

A setting given twice is ambiguous (which one did the client mean?), so it is refused by name in
every dialect; only a dialect's list-valued keys (keyword phrases, timestamp granularities) may
repeat. Each dialect turns the ValueError into its own error.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def parse_bool(name: str, raw: str) -> bool:
    """`raw` as a switch; ValueError naming `name` and the spellings accepted."""
    text = str(raw).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(f"{name} must be true or false ({'/'.join(TRUE[1:])} or {'/'.join(FALSE[1:])} also), "
                     f"got {str(raw)[:20]!r}")


def group(pairs: Iterable[tuple[str, str]], repeatable: Collection[str] = ()) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(key -> its one value, key -> every value of each repeatable key) from (key, value) pairs in
    order. ValueError naming a key outside `repeatable` that is given more than once."""
    one: dict[str, str] = {}
    many: dict[str, list[str]] = {}
    for key, value in pairs:
        if key in repeatable:
            many.setdefault(key, []).append(value)
        elif key in one:
            allowed = f"only {', '.join(repr(k) for k in repeatable)} may repeat" if repeatable else "none may repeat"
            raise ValueError(f"parameter {key[:40]!r} given more than once; {allowed}")
        else:
            one[key] = value
    return one, many
