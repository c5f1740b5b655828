"""What Home Assistant's Supervisor accepts of an add-on, written down from its source
(home-assistant/supervisor: addons/validate.py, addons/options.py, store/validate.py, const.py):
the rules a config.yaml, build.yaml and repository.yaml must keep, and whether the add-on's
default options fit its own schema. A config the Supervisor rejects does not fail loudly: the
store logs a warning and leaves the add-on out, so these are checked here."""

from __future__ import annotations

import re

ARCHES = {"aarch64", "amd64", "armhf", "armv7", "i386"}
REQUIRED = ("name", "version", "slug", "description", "arch")
SLUG = re.compile(r"^[-_.A-Za-z0-9]+$")
PORT_KEY = re.compile(r"^\d+(?:/(?:tcp|udp))?$")
STARTUP = {"initialize", "system", "services", "application", "once"}
BOOT = {"auto", "manual", "manual_only"}
MAP_TYPES = {"data", "config", "ssl", "addons", "backup", "share", "media", "homeassistant_config",
             "all_addon_configs", "addon_config"}
# the option types a schema entry may name, with (min,max) where the Supervisor allows them and a
# trailing "?" for an optional option
ELEMENT = re.compile(r"^(?:bool|email|url|port|device(?:\(subsystem=[a-z]+\))?|str(?:\(\d*,\d*\))?"
                     r"|password(?:\(\d*,\d*\))?|int(?:\(-?\d*,-?\d*\))?|float(?:\(-?[\d.]*,-?[\d.]*\))?"
                     r"|match\(.*\)|list\(.+\))\??$")
# an image name a build.yaml may give as its base: at least one "/" (a registry or a namespace)
BUILD_IMAGE = re.compile(r"^([a-zA-Z\-.:\d{}]+/)*?([\-\w{}]+)/([\-\w{}]+)(:[.\-\w{}]+)?$")


def config_problems(config: dict) -> list[str]:
    """What the Supervisor would refuse in an add-on's config.yaml (empty: nothing)."""
    problems = [f"{key} is missing" for key in REQUIRED if not config.get(key)]
    if not SLUG.match(str(config.get("slug", ""))):
        problems.append(f"slug {config.get('slug')!r} is not letters, digits, '-', '_' and '.'")
    arch = config.get("arch") or []
    problems += [f"arch {a!r} is not one of {sorted(ARCHES)}" for a in arch if a not in ARCHES]
    if config.get("startup", "application") not in STARTUP:
        problems.append(f"startup {config['startup']!r} is not one of {sorted(STARTUP)}")
    if config.get("boot", "auto") not in BOOT:
        problems.append(f"boot {config['boot']!r} is not one of {sorted(BOOT)}")
    for key, value in (config.get("ports") or {}).items():
        if not PORT_KEY.match(str(key)):
            problems.append(f"port {key!r} is not PORT or PORT/tcp or PORT/udp")
        if value is not None and not (isinstance(value, int) and 1 <= value <= 65535):
            problems.append(f"port {key} maps to {value!r}: a port 1..65535 or null")
    for entry in config.get("map") or []:
        kind = entry.get("type") if isinstance(entry, dict) else str(entry).split(":")[0]
        if kind not in MAP_TYPES:
            problems.append(f"map entry {entry!r} is not one of {sorted(MAP_TYPES)}")
    if not all(isinstance(d, str) for d in config.get("discovery") or []):
        problems.append("discovery is a list of service names")
    schema, options = config.get("schema") or {}, config.get("options") or {}
    for name, element in schema.items():
        problems += [f"schema {name}: {p}" for p in _element_problems(element)]
    for name, value in options.items():
        if name not in schema:
            problems.append(f"option {name} has no schema entry")
        elif not _element_problems(schema[name]):
            problems += [f"option {name}: {p}" for p in value_problems(schema[name], value)]
    for name, element in schema.items():
        optional = isinstance(element, str) and element.endswith("?") or isinstance(element, list)
        if name not in options and not optional:
            problems.append(f"option {name} is required by the schema and has no default")
    return problems


def _element_problems(element) -> list[str]:
    if isinstance(element, str):
        return [] if ELEMENT.match(element) else [f"{element!r} is not a type the Supervisor knows"]
    if isinstance(element, list):
        if len(element) != 1 or isinstance(element[0], list):
            return ["a list schema holds one element (a type or a mapping), not a list"]
        return _element_problems(element[0])
    if isinstance(element, dict):
        return [p for v in element.values() for p in _element_problems(v)]
    return [f"{element!r} is not a type, a list or a mapping"]


def value_problems(element, value) -> list[str]:
    """Whether an option's value fits its schema entry, as the Supervisor checks options."""
    if isinstance(element, list):
        if not isinstance(value, list):
            return [f"{value!r} is not a list"]
        return [p for v in value for p in value_problems(element[0], v)]
    kind = element.rstrip("?")
    if kind.startswith("list("):
        choices = kind[5:-1].split("|")
        return [] if str(value) in choices else [f"{value!r} is not one of {choices}"]
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            return [f"{value!r} is not an integer"]
        low, high = (kind[4:-1].split(",") if "(" in kind else ("", ""))
        if low and value < int(low) or high and value > int(high):
            return [f"{value} is outside {low or '-inf'}..{high or 'inf'}"]
        return []
    if kind == "bool":
        return [] if isinstance(value, bool) else [f"{value!r} is not true or false"]
    if kind.startswith("match("):
        return [] if re.fullmatch(kind[6:-1], str(value)) else [f"{value!r} does not match {kind[6:-1]}"]
    if kind.startswith(("str", "password")):
        return [] if isinstance(value, str) else [f"{value!r} is not text"]
    return []


def build_problems(build: dict) -> list[str]:
    """What the Supervisor would refuse in build.yaml."""
    problems = []
    base = build.get("build_from") or {}
    for arch, image in (base.items() if isinstance(base, dict) else [("*", base)]):
        if arch != "*" and arch not in ARCHES:
            problems.append(f"build_from {arch!r} is not one of {sorted(ARCHES)}")
        if not BUILD_IMAGE.match(str(image)):
            problems.append(f"build_from {image!r} is not REGISTRY/NAME[:TAG] (Docker Hub's own images: "
                            "docker.io/library/NAME)")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (build.get("args") or {}).items()):
        problems.append("args maps names to strings")
    return problems
