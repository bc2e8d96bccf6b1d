"""Finds every rule class in ``torchopt.codemods`` and checks that codes and names are unique."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re

from torchopt.rewrite.rule import Rule

RULE_PACKAGE = "torchopt.codemods"
_CODE = re.compile(r"^TOP\d{3}$")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class RegistryError(Exception):
    pass


def collect(package: str = RULE_PACKAGE) -> dict[str, type[Rule]]:
    """Import every module of ``package`` and return its Rule subclasses by code."""
    pkg = importlib.import_module(package)
    rules: dict[str, type[Rule]] = {}
    names: dict[str, str] = {}
    infos = pkgutil.walk_packages(pkg.__path__, prefix=f"{package}.")
    for info in sorted(infos, key=lambda i: i.name):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue  # private modules hold no rules (a module without a Rule is skipped below anyway)
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if not (isinstance(obj, type) and issubclass(obj, Rule) and obj is not Rule):
                continue
            if obj.__module__ != mod.__name__ or not hasattr(obj, "code"):
                continue
            if not _CODE.match(obj.code):
                raise RegistryError(f"{obj.__qualname__}: code {obj.code!r} is not TOP + 3 digits")
            if not _NAME.match(obj.name):
                raise RegistryError(f"{obj.__qualname__}: name {obj.name!r} is not kebab-case")
            if obj.code in rules and rules[obj.code] is not obj:
                raise RegistryError(
                    f"duplicate rule code {obj.code}: {rules[obj.code].__qualname__} and {obj.__qualname__}"
                )
            if obj.name in names and names[obj.name] != obj.code:
                raise RegistryError(f"duplicate rule name {obj.name!r} ({names[obj.name]}, {obj.code})")
            rules[obj.code] = obj
            names[obj.name] = obj.code
    return dict(sorted(rules.items()))


@functools.lru_cache(maxsize=1)
def all_rules() -> dict[str, type[Rule]]:
    return collect()


def source_path(rule: type[Rule]) -> str:
    """Where a rule's code lives, relative to the project root: one hop from a code to its file."""
    return rule.__module__.replace(".", "/") + ".py"


def families() -> dict[str, str]:
    """Family name -> code prefix (e.g. ``device`` -> ``TOP1``)."""
    out: dict[str, str] = {}
    for code, rule in all_rules().items():
        out.setdefault(rule.family, code[:4])
    return out
