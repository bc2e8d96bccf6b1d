"""Finds every rule class in ``torchopt.codemods`` and checks that codes and names are unique.

A command that checks one file should not pay for importing all the rule modules when the file's
text rules most of them out. So the registry reads a table first (``torchopt/codemods/_index.py``,
generated from the rules by ``python -m torchopt.rewrite.registry --write-index``): every rule's
code, name, family, module and the declarations the engine needs before it runs a rule (the
``requires``/``prefilter`` substrings, ``opt_in``, ``min_torch``, ``locality``). A rule's module is
imported only when its class is asked for. The table also records the size of every file of the
rules' package: when a file was added, removed or changed size since it was generated, the table is
not trusted and every rule module is imported, as without it (``tests/test_rule_index.py`` fails
until it is generated again).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:
    from torchopt.rewrite.rule import Rule

RULE_PACKAGE = "torchopt.codemods"
INDEX_MODULE = f"{RULE_PACKAGE}._index"
_CODE = re.compile(r"^TOP\d{3}$")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class RegistryError(Exception):
    pass


@dataclass(frozen=True)
class RuleInfo:
    """What the engine, the selectors and the configuration read of a rule without importing it."""

    code: str
    name: str
    family: str
    module: str
    qualname: str
    requires: tuple[str, ...] = ()
    prefilter: tuple[str, ...] = ()
    opt_in: bool = False
    min_torch: tuple[int, int] | None = None
    locality: str = "component"

    @classmethod
    def of(cls, rule: type["Rule"]) -> "RuleInfo":
        return cls(
            code=rule.code,
            name=rule.name,
            family=rule.family,
            module=rule.__module__,
            qualname=rule.__qualname__,
            requires=tuple(rule.requires),
            prefilter=tuple(rule.prefilter),
            opt_in=bool(getattr(rule, "opt_in", False)),
            min_torch=(rule.min_torch[0], rule.min_torch[1]) if rule.min_torch else None,
            locality=rule.locality,
        )

    def declared_match(self, text: str) -> bool:
        """The declared substrings (``Rule.could_match``'s default test): every ``requires`` one and
        one ``prefilter`` one (if any) occur in ``text``. The engine asks this before it imports the
        rule; a rule's own ``could_match`` only narrows it."""
        if self.requires and not all(tok in text for tok in self.requires):
            return False
        return not self.prefilter or any(tok in text for tok in self.prefilter)


def collect(package: str = RULE_PACKAGE) -> dict[str, type["Rule"]]:
    """Import every module of ``package`` and return its Rule subclasses by code."""
    from torchopt.rewrite.rule import Rule

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


class Registry(Mapping[str, type["Rule"]]):
    """The rules by code, read from the index: codes, names and declarations without any import;
    a rule's class (and so its module) is imported the first time it is looked up."""

    def __init__(self, infos: Mapping[str, RuleInfo]) -> None:
        self._infos = dict(sorted(infos.items()))
        self._classes: dict[str, type[Rule]] = {}

    def info(self, code: str) -> RuleInfo:
        return self._infos[code]

    def __getitem__(self, code: str) -> type["Rule"]:
        cls = self._classes.get(code)
        if cls is None:
            info = self._infos[code]
            cls = getattr(importlib.import_module(info.module), info.qualname)
            if getattr(cls, "code", None) != code:
                raise RegistryError(f"{INDEX_MODULE}: {info.module}.{info.qualname} is not {code}; regenerate it")
            self._classes[code] = cls
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, code: object) -> bool:
        return code in self._infos


def info_of(rules: Mapping[str, type["Rule"]], code: str) -> RuleInfo:
    """``code``'s declarations: from the index when ``rules`` is the registry (no import), else
    read from its class (a mapping of classes made by hand, e.g. in a test)."""
    if isinstance(rules, Registry):
        return rules.info(code)
    return RuleInfo.of(rules[code])


def _package_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "codemods")


def package_files(root: str | None = None) -> dict[str, int]:
    """Every ``.py`` file of the rules' package (relative path -> size in bytes), the index aside."""
    root = root or _package_dir()
    out: dict[str, int] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel)) as entries:
            for entry in entries:
                path = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(path + "/")
                elif entry.name.endswith(".py") and path != "_index.py":
                    out[path] = entry.stat().st_size
    return out


def load_index() -> dict[str, RuleInfo] | None:
    """The index's rules, or None when there is none or it does not describe the files there now."""
    try:
        index = importlib.import_module(INDEX_MODULE)
        if package_files() != index.FILES:
            return None
        return {row[0]: RuleInfo(*row) for row in index.RULES}
    except (ImportError, OSError, AttributeError, TypeError):
        return None


@functools.lru_cache(maxsize=1)
def all_rules() -> Mapping[str, type["Rule"]]:
    """Every rule by code: the lazy registry when the index is up to date, else every module imported."""
    infos = None if os.environ.get("TORCHOPT_NO_RULE_INDEX") else load_index()
    return collect() if infos is None else Registry(infos)


def source_path(rule: type["Rule"]) -> str:
    """Where a rule's code lives, relative to the project root: one hop from a code to its file."""
    return rule.__module__.replace(".", "/") + ".py"


def families() -> dict[str, str]:
    """Family name -> code prefix (e.g. ``device`` -> ``TOP1``)."""
    out: dict[str, str] = {}
    rules = all_rules()
    for code in rules:
        out.setdefault(info_of(rules, code).family, code[:4])
    return out


def index_text(rules: Mapping[str, type["Rule"]], files: Mapping[str, int]) -> str:
    """The source of ``_index.py`` for ``rules`` and the package's ``files``."""
    rows = "".join(f"    {tuple(vars(RuleInfo.of(rules[code])).values())!r},\n" for code in sorted(rules))
    sizes = "".join(f"    {path!r}: {size},\n" for path, size in sorted(files.items()))
    return (
        '"""Generated by `python -m torchopt.rewrite.registry --write-index` from the rules: do not edit.\n'
        "Each rule's code, name, family, module, class and the declarations read before it is imported\n"
        '(rewrite/registry.py); FILES is what the rules\' package held then (path -> bytes)."""\n\n'
        "# fmt: off\n"
        f"RULES = (\n{rows})\n\nFILES = {{\n{sizes}}}\n"
        "# fmt: on\n"
    )


def write_index() -> str:
    """(Re)write the index from the rules as they are now; returns its path."""
    path = os.path.join(_package_dir(), "_index.py")
    text = index_text(collect(), package_files())
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] != ["--write-index"]:
        sys.exit("usage: python -m torchopt.rewrite.registry --write-index")
    print(write_index())
