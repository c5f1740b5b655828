"""The rules every dialect's parameters share, each defined once: what true and false are spelled
as, what a key given more than once means (docs/protocol.md, "Query parameters") and which
language a client named.

A setting given twice is ambiguous (which one did the client mean?), so it is refused by name in
every dialect; only a dialect's list-valued keys (keyword phrases, timestamp granularities) may
repeat. Each dialect turns the ValueError into its own error.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from whistle_stream.dims import unknown_language

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


DETECT = ("auto", "multi")  # a language a client may name to have it detected


def model_language(language: object, languages: Sequence[str] = ()) -> str | None:
    """The model's code for the language a client named, None to detect it (none named, or one of
    DETECT): a region is dropped ("en-US" -> "en"). ValueError (`unknown_language`) when the
    model does not know it; an empty `languages` accepts any."""
    if language is None or language == "":
        return None
    if not isinstance(language, str):
        raise ValueError(unknown_language(language, languages))
    code = language.split("-")[0].strip().lower()
    if code in DETECT:
        return None
    if not code or (languages and code not in languages):
        raise ValueError(unknown_language(language, languages))
    return code


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
