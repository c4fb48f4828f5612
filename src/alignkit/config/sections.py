"""Per-algorithm config sections and the algorithm names the ``algorithm`` key accepts.

Each algorithm file defines its section's dataclass and registers it here under the YAML key users
write (``dpo:``, ``reward:``, ``sft:`` ...), so a new algorithm adds a section without touching the
central schema. ``alignkit.algorithms`` registers every algorithm's name here too.

config/ is the bottom floor: it never imports the algorithms. Whoever loads a config (the CLI, the
runner, a user's script) imports ``alignkit.algorithms`` first, which fills both registries; a config
loaded before that fails with :data:`NOT_REGISTERED` instead of rejecting ``dpo:`` as an unknown key
or handing out a section's defaults in place of what the YAML says.

A registered section is read from the top level of the YAML like the core sections, checked by the
same typed conversion (ranges, choices, unknown keys with a close match), and its own cross-field
checks run in the dataclass's ``__post_init__`` (raise :class:`~alignkit.errors.ConfigError` naming
the dotted key). Code reads one with ``cfg.section(DPOConfig)``; an absent section holds its defaults.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from alignkit.registry import Registry

T = TypeVar("T")

SECTIONS: Registry[type] = Registry("config section")
#: the algorithms by the value of the ``algorithm`` key (classes; registered by alignkit.algorithms, or by a
#: plugin with :func:`register_algorithm`). It lives here so that config checks the key without importing them.
ALGORITHMS: Registry[type] = Registry("algorithm")

NOT_REGISTERED = ("no algorithms are registered: import alignkit.algorithms (it registers the algorithms and "
                  "their config sections) before loading or reading a config; the alignkit CLI does this")


def register_section(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``@register_section("dpo")`` on the section's dataclass."""
    return SECTIONS.register(name)  # type: ignore[return-value]


def register_algorithm(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``@register_algorithm("my_algo")`` makes ``algorithm: my_algo`` run that class
    (a plugin module named in the config's ``plugins:`` registers its own this way)."""
    return ALGORITHMS.register(name)  # type: ignore[return-value]


def require_registrations() -> None:
    """Raise (a bug in the caller, not a user error) when a config is read before the registrations."""
    if not ALGORITHMS.names():
        raise RuntimeError(NOT_REGISTERED)


def registered_sections() -> dict[str, type]:
    """YAML key -> section dataclass, in name order."""
    require_registrations()
    return {name: SECTIONS.get(name) for name in SECTIONS.names()}


def section_name(cls: type) -> str:
    """The YAML key ``cls`` is registered under."""
    for name in SECTIONS.names():
        if SECTIONS.get(name) is cls:
            return name
    raise KeyError(f"{cls.__name__} is not a registered config section (decorate it with @register_section)")
